"""Real chat templates (tests/templates/, sources in tests/templates/SOURCES) driven through the
real proxy and compared by token ids with transformers' ``apply_chat_template``.

`model_dir` builds a model directory for a fixture: the tiny model's tokenizer (plus the family's
control tokens when the tiny one lacks them: Llama 3's header and end-of-turn tokens),
``tokenizer_config.json`` (bos/eos), ``generation_config.json`` (end-of-turn ids) and the template
as ``chat_template.jinja``. `drive` runs a 5-call agent (system message, parallel tool calls,
reasoning, a new user turn) with the openai client through the proxy over HTTP to a scripted
engine, echoing each reply as a harness does, and returns, per call, the ids the engine got and the
ids transformers gives for the same messages. Used by tests/proxy/test_templates_real.py and
benchmarks/token_truth_templates.py.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

TEMPLATES = Path(__file__).parents[1] / "templates"
TINY_TOKENIZER = Path(__file__).parents[2] / "gyre" / "assets" / "tokenizer.json"
# a Llama 3 tokenizer has none of ChatML's tokens: the tiny one's are renamed, the rest added
LLAMA3_RENAMED = {"<|endoftext|>": "<|end_of_text|>", "<|im_start|>": "<|start_header_id|>", "<|im_end|>": "<|eot_id|>"}
LLAMA3_ADDED = ["<|begin_of_text|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"]


def _llama3_tokenizer() -> Tokenizer:
    spec = json.loads(TINY_TOKENIZER.read_text())
    for t in spec["added_tokens"]:
        t["content"] = LLAMA3_RENAMED.get(t["content"], t["content"])
    spec["model"]["vocab"] = {LLAMA3_RENAMED.get(k, k): i for k, i in spec["model"]["vocab"].items()}
    # merges that spelled the old names out of characters would now make tokens the vocabulary lacks
    spec["model"]["merges"] = [m for m in spec["model"]["merges"] if "".join(m) not in LLAMA3_RENAMED]
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA3_ADDED])
    return tok


@dataclass(frozen=True)
class Fixture:
    template: str  # file under tests/templates/
    tool_parser: str
    reasoning_parser: str = "none"
    reasoning: bool = False  # the model thinks (reasoning_content in its turns)
    parallel: bool = True  # the template takes several tool calls in one turn
    llama: bool = False  # Llama 3 control tokens (else ChatML's)


FIXTURES = {
    "qwen2_5": Fixture("qwen2_5.jinja", "hermes"),
    "qwen3": Fixture("qwen3.jinja", "hermes", "qwen3", reasoning=True),
    "qwen3_coder": Fixture("qwen3_coder.jinja", "qwen3_coder"),
    "qwen3_5": Fixture("qwen3_5.jinja", "qwen3_coder", "qwen3", reasoning=True),
    "qwen3_6": Fixture("qwen3_6.jinja", "qwen3_coder", "qwen3", reasoning=True),
    "llama3_1": Fixture("llama3_1.jinja", "llama3", parallel=False, llama=True),
}

TOOLS = [
    {"type": "function", "function": {"name": "bash", "description": "run a shell command", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},
    {"type": "function", "function": {"name": "read_file", "description": "read a file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
]


def _call(name: str, **args) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": args}}


def script(f: Fixture) -> list[tuple[list[dict], dict]]:
    """(messages the harness adds before the call, the assistant turn the model samples) per call."""
    first = [_call("bash", command="ls src"), _call("bash", command="ls tests")]
    turns = [
        ([{"role": "system", "content": "You are a coding agent. Work in /repo."},
          {"role": "user", "content": "Find the failing test and fix it."}],
         {"reasoning_content": "I should list the files first.", "content": "",
          "tool_calls": first if f.parallel else first[:1]}),
        ([{"role": "tool", "content": "main.py\nutil.py"}] + ([{"role": "tool", "content": "test_main.py"}]
                                                              if f.parallel else []),
         {"reasoning_content": "The test is in tests/test_main.py.", "content": "I will read the test.",
          "tool_calls": [_call("read_file", path="tests/test_main.py")]}),
        ([{"role": "tool", "content": "def test_add():\n    assert add(1, 2) == 3"}],
         {"reasoning_content": "add subtracts.", "content": "The bug is in add: it subtracts."}),
        ([{"role": "user", "content": "Fix it and run the tests."}],
         {"reasoning_content": "Edit, then test.", "content": "",
          "tool_calls": [_call("bash", command="sed -i 's/a - b/a + b/' src/main.py && pytest -q")]}),
        ([{"role": "tool", "content": "1 passed"}], {"content": "Fixed: all tests pass."}),
    ]
    out = []
    for new, turn in turns:
        turn = {"role": "assistant", **turn}
        if not f.reasoning:
            turn.pop("reasoning_content", None)
        out.append((new, turn))
    return out


def model_dir(name: str, dest: Path) -> Path:
    """A model directory for fixture `name` (tokenizer, configs, the template) under `dest`."""
    f = FIXTURES[name]
    dest.mkdir(parents=True, exist_ok=True)
    if f.llama:
        tok = _llama3_tokenizer()
        bos, eos, pad, ends = "<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>", ["<|end_of_text|>", "<|eom_id|>",
                                                                                     "<|eot_id|>"]
    else:
        tok = Tokenizer.from_file(str(TINY_TOKENIZER))
        bos, eos, pad, ends = None, "<|im_end|>", "<|endoftext|>", ["<|im_end|>", "<|endoftext|>"]
    tok.save(str(dest / "tokenizer.json"))
    cfg = {"bos_token": bos, "eos_token": eos, "pad_token": pad, "model_max_length": 32768}
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    (dest / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.token_to_id(t) for t in ends]}))
    (dest / "chat_template.jinja").write_text((TEMPLATES / f.template).read_text())
    return dest


def as_hf(messages: list[dict]) -> list[dict]:
    """Messages as transformers' templates read them (tool-call arguments as objects)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**t, "function": {**t["function"], "arguments": json.loads(t["function"]["arguments"])}}
                               for t in m["tool_calls"]]
        out.append(m)
    return out


class Reference:
    """transformers' tokenizer of a model directory: the ids and texts a fixture is held to."""

    def __init__(self, directory: Path):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(directory))

    def ids(self, messages: list[dict], tools=TOOLS, generation: bool = True) -> list[int]:
        out = self.tok.apply_chat_template(as_hf(messages), tools=tools, add_generation_prompt=generation,
                                           tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    def text(self, messages: list[dict], generation: bool) -> str:
        return self.tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=generation, tokenize=False)

    def sampled(self, messages: list[dict], turn: dict, end: str) -> list[int]:
        """What a model that follows its template samples for `turn`: the template's text of the
        turn after the generation prompt, up to its end-of-turn token, then that token."""
        hf = as_hf(messages)
        prompt = self.text(hf, True)
        whole = self.text(hf + [turn], False)
        assert whole.startswith(prompt), "the template's generation prompt does not open its assistant turn"
        body = whole[len(prompt):]
        body = body[: body.rindex(end)]
        return self.tok.encode(body, add_special_tokens=False) + [self.tok.convert_tokens_to_ids(end)]


@dataclass
class CallResult:
    proxy_ids: list[int] | None  # what the engine got (None: the proxy answered an error)
    reference_ids: list[int]
    error: str | None = None
    output_ids: list[int] | None = None  # what the engine answered

    @property
    def equal(self) -> bool:
        return self.proxy_ids == self.reference_ids


@contextmanager
def serve(directory: Path, overrides: list[str]):
    """The real proxy over HTTP for `directory` (``[proxy]`` overrides) in front of a scripted
    engine: yields (proxy, engine, base_url). Raises what the proxy raises at start."""
    from gyre.config import load_config
    from gyre.engine.router import Router
    from gyre.model.tokenizer import load_tokenizer
    from gyre.proxy.routes import create_app, start_site
    from gyre.proxy.server import Proxy, template_options
    from support.loop_thread import LoopThread
    from support.scripted_engine import ScriptedEngine

    cfg = load_config(None, ["proxy.chat_template=model", *overrides])
    tokenizer = load_tokenizer(directory)
    lt = LoopThread()
    engine = ScriptedEngine(decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
    state: dict = {}

    async def up():
        state["erunner"], eport = await start_site(engine.app(), "127.0.0.1", 0)
        state["router"] = Router([f"http://127.0.0.1:{eport}"])
        state["proxy"] = Proxy(state["router"], tokenizer, **template_options(cfg.proxy, directory))
        state["prunner"], state["port"] = await start_site(create_app(state["proxy"], admin_key="admin"),
                                                           "127.0.0.1", 0)

    async def down():
        for k in ("prunner", "erunner"):
            if k in state:
                await state[k].cleanup()
        if "router" in state:
            await state["router"].close()

    try:
        lt.run(up())
        yield state["proxy"], engine, f"http://127.0.0.1:{state['port']}/v1"
    finally:
        lt.run(down())
        lt.close()


def drive(directory: Path, name: str, history: str = "template", echo_reasoning: bool = True) -> list[CallResult]:
    """The fixture's 5 calls through the real proxy (openai client over HTTP, scripted engine).
    ``echo_reasoning``: the harness sends each reply's ``reasoning_content`` back (many drop it).
    Raises what the proxy raises at start (a template it refuses)."""
    from openai import APIError, OpenAI

    f = FIXTURES[name]
    ref = Reference(directory)
    end = "<|eot_id|>" if f.llama else "<|im_end|>"
    overrides = [f"proxy.history={history}", f"proxy.tool_parser={f.tool_parser}",
                 f"proxy.reasoning_parser={f.reasoning_parser}"]
    results: list[CallResult] = []
    with serve(directory, overrides) as (proxy, engine, base_url):
        client = OpenAI(base_url=base_url, api_key=proxy.register("e1", task="t", group=0), max_retries=0)
        messages: list[dict] = []
        ids = 0
        for new, turn in script(f):
            for m in new:
                if m["role"] == "tool":
                    m = {**m, "tool_call_id": f"call_{ids}"}
                    ids += 1
                messages.append(m)
            reference = ref.ids(messages)
            sampled = ref.sampled(messages, turn, end)
            engine.script = [sampled]
            n = len(engine.requests)
            try:
                reply = client.chat.completions.create(model="main", messages=messages, tools=TOOLS)
            except APIError as e:
                results.append(CallResult(None, reference, f"{type(e).__name__}: {e}"))
                break
            results.append(CallResult(list(engine.requests[n]["input_ids"]), reference, output_ids=sampled))
            m = reply.choices[0].message
            echo: dict = {"role": "assistant", "content": m.content}
            reasoning = (m.model_extra or {}).get("reasoning_content")
            if reasoning and echo_reasoning:
                echo["reasoning_content"] = reasoning
            if m.tool_calls:
                echo["tool_calls"] = [{"id": f"call_{ids + i}", "type": "function",
                                       "function": {"name": t.function.name, "arguments": t.function.arguments}}
                                      for i, t in enumerate(m.tool_calls)]
            messages.append(echo)
    return results
