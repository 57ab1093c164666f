"""The model directory's own chat template (Jinja), rendered as transformers'
``apply_chat_template`` renders it, plus what the proxy needs on top: per-message deltas (so stored
ids of messages already seen are reused) and a conformance probe (is the template append-only?).

Where the template comes from: ``chat_template.jinja`` in the directory, else the
``chat_template`` of ``tokenizer_config.json`` (a string, or a list of ``{name, template}`` of
which "default" is used). The Jinja environment is transformers' (sandboxed, ``trim_blocks``,
``lstrip_blocks``, ``raise_exception``, a ``tojson`` that keeps non-ASCII).

Segments: message i's text runs from where message i-1's text became final to where its own does
(`ChatTemplate.stable_end`: the part of the render that no following message nor the generation
prompt changes), cut from the render of the whole conversation, so a template that closes a turn
only when the next message is known still cuts into segments whose concatenation is exactly
``apply_chat_template``'s prompt. Cost: a few renders of the conversation per new message.

Cuts fall on token boundaries: a cut is moved back to the nearest edge of an added token
(``ChatTemplate.atoms``, set from the tokenizer), where a tokenizer always splits, so tokenizing
the segments one by one gives the ids of tokenizing the whole prompt, and no special token is ever
cut in two (a character cut between ``<|im_end|>`` and ``<|im_start|>`` shares ``<|im_``).
A template that refuses a partial conversation (Qwen3.5: "No user query found" for a system
message alone) is asked for that prefix followed by two different user turns instead: the text
they share is the prefix's final text.
`conformance` says whether sampled turns survive later renders (append-only) and, given the
tokenizer, whether the segments' ids equal the whole prompt's ids.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from gyre.model.families import ModelFormatError


class TemplateError(ModelFormatError):
    """The chat template cannot be loaded or rendered (the message names the step)."""


def load_chat_template(model_dir: str | Path) -> str | None:
    """The directory's chat template source, or None when it has none."""
    d = Path(model_dir)
    jinja = d / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(encoding="utf-8")
    cfg = d / "tokenizer_config.json"
    if not cfg.exists():
        return None
    try:
        tpl = json.loads(cfg.read_text(encoding="utf-8")).get("chat_template")
    except json.JSONDecodeError as e:
        raise TemplateError(f"{cfg}: unreadable JSON ({e})") from None
    if isinstance(tpl, list):
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default")
    return tpl if isinstance(tpl, str) else None


# the special-token variables transformers passes to a template (its special_tokens_map)
_TOKEN_VARIABLES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _tokenizer_config(model_dir: Path) -> dict:
    cfg = model_dir / "tokenizer_config.json"
    if not cfg.exists():
        return {}
    try:
        return json.loads(cfg.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise TemplateError(f"{cfg}: unreadable JSON ({e})") from None


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # the serialised AddedToken form
        value = value.get("content")
    return value if isinstance(value, str) else None


def template_variables(model_dir: str | Path) -> dict[str, str]:
    """``bos_token``, ``eos_token``, ... of ``tokenizer_config.json``, as transformers passes them
    to the template (Llama 3 opens with ``{{ bos_token }}``)."""
    cfg = _tokenizer_config(Path(model_dir))
    return {k: t for k in _TOKEN_VARIABLES if (t := _token_text(cfg.get(k))) is not None}


def end_token_ids(model_dir: str | Path, token_to_id: Callable[[str], int | None]) -> list[int]:
    """The ids that end a turn, from the model directory: ``generation_config.json``'s
    ``eos_token_id`` (one id or a list: Llama 3 lists ``<|eot_id|>``, ``<|eom_id|>``,
    ``<|end_of_text|>``) and ``tokenizer_config.json``'s ``eos_token``. Empty when neither says."""
    d = Path(model_dir)
    ids: list[int] = []
    gen = d / "generation_config.json"
    if gen.exists():
        try:
            eos = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
        except json.JSONDecodeError as e:
            raise TemplateError(f"{gen}: unreadable JSON ({e})") from None
        eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in eos):
            raise TemplateError(f"{gen}: eos_token_id must be an integer or a list of integers, got {eos!r}")
        ids += eos
    text = _token_text(_tokenizer_config(d).get("eos_token"))
    if text is not None:
        tid = token_to_id(text)
        if tid is None:
            raise TemplateError(f"{d / 'tokenizer_config.json'}: eos_token {text!r} is not in tokenizer.json")
        ids.append(tid)
    return list(dict.fromkeys(ids))


def _environment():
    from jinja2.exceptions import TemplateError as JinjaError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise JinjaError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


# What may follow a message: one stand-in per role (only used to find where a message's text is
# final, i.e. the same whatever comes next).
_NEXT = [{"role": "user", "content": "U"}, {"role": "tool", "content": "T"},
         {"role": "assistant", "content": "A"}]
# Two user turns that differ from their first character: what a prefix the template refuses on its
# own renders as, whatever follows (see `ChatTemplate.stable_end`).
_USERS = [{"role": "user", "content": "U"}, {"role": "user", "content": "V"}]


def _common(a: str, b: str) -> int:
    """Length of the common prefix (binary search over slice comparisons: C speed on long text)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass
class ChatTemplate:
    source: str
    variables: dict = field(default_factory=dict)  # bos_token, eos_token, ... (`template_variables`)
    atoms: tuple[str, ...] = ()  # the tokenizer's added tokens: cuts fall only at their edges
    _compiled: object = field(default=None, repr=False)
    _atom_re: object = field(default=None, repr=False)

    def __post_init__(self):
        from jinja2 import TemplateSyntaxError

        try:
            self._compiled = _environment().from_string(self.source)
        except TemplateSyntaxError as e:
            raise TemplateError(f"chat template does not compile: {e}") from None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ChatTemplate | None":
        src = load_chat_template(model_dir)
        return cls(src, template_variables(model_dir)) if src else None

    def bind(self, atoms) -> None:
        """Cut only at the edges of these added tokens (the tokenizer's; once, at start)."""
        self.atoms = tuple(sorted(set(atoms), key=len, reverse=True))
        self._atom_re = re.compile("|".join(map(re.escape, self.atoms))) if self.atoms else None

    def snap(self, text: str, cut: int) -> int:
        """The last edge of an added token in `text` at or before `cut` (0 when none): a token
        boundary whatever the text around it (unbound: `cut` itself)."""
        if self._atom_re is None or cut <= 0:
            return cut if self._atom_re is None else 0
        reach = max(map(len, self.atoms))
        width = 4096
        while True:  # look back a window first: the edge is almost always a few characters back
            lo = max(0, cut - width)
            best = -1
            for m in self._atom_re.finditer(text, lo, cut + reach):
                if m.start() > cut:
                    break
                best = m.end() if m.end() <= cut else m.start()
            if best >= 0 or lo == 0:
                return max(best, 0)
            width *= 16

    def render(self, messages: list[dict], tools: list[dict] | None = None, *,
               add_generation_prompt: bool = False, **kwargs) -> str:
        from jinja2.exceptions import TemplateError as JinjaError

        try:
            return self._compiled.render(**{**self.variables, **kwargs}, messages=messages, tools=tools or None,
                                         add_generation_prompt=add_generation_prompt)
        except JinjaError as e:
            raise TemplateError(f"chat template refused the conversation: {e}") from None

    # --- incremental ------------------------------------------------------------------------
    def stable_end(self, messages: list[dict], tools: list[dict] | None = None) -> int:
        """Length of the text of `messages` that stays the same whatever follows (another message
        of any role, or the generation prompt): where the last message's segment ends. A
        template that closes a tool turn only when a non-tool message follows leaves the closing
        to the next segment, as Gyre's own ChatML renderer does. The end is moved back to a token
        boundary (`snap`)."""
        if not messages:
            return 0
        try:
            whole = self.render(messages, tools)
        except TemplateError:  # refused on its own (no user turn yet): what two user turns share
            first, second = (self.render(messages + [u], tools) for u in _USERS)
            return self.snap(first, _common(first, second))
        ends = [_common(whole, self.render(messages, tools, add_generation_prompt=True))]
        for nxt in _NEXT:
            try:
                ends.append(_common(whole, self.render(messages + [nxt], tools)))
            except TemplateError:
                pass  # the template refuses that role here (e.g. tool after user): it cannot follow
        return self.snap(whole, min(ends))

    def segments(self, messages: list[dict], tools: list[dict] | None = None, start: int = 0,
                 cut: int | None = None) -> tuple[list[str], str]:
        """Texts of messages[start:] as segments (each ends where its text is final) and the
        generation prompt after them, cut from the template's render of the whole conversation.
        Segment `start` begins at text offset `cut` (default: where messages[:start] become
        final). With the default cut, the texts before `start` plus these are exactly the prompt
        transformers' ``apply_chat_template(..., add_generation_prompt=True)`` gives."""
        prompt = self.render(messages, tools, add_generation_prompt=True)
        if cut is None:
            cut = self.stable_end(messages[:start], tools) if start else 0
        out = []
        for i in range(start, len(messages)):
            # the last message too: what only the generation prompt closes (a tool turn) goes into
            # the call's prompt text, as Gyre's built-in renderer puts it
            end = max(self.stable_end(messages[: i + 1], tools), cut)
            out.append(prompt[cut:end])
            cut = end
        return out, prompt[cut:]


PROBE = [  # a conversation with each thing a template may treat specially
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Fix the bug in main.py."},
    {"role": "assistant", "reasoning_content": "I should read the file first.", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": {"command": "cat main.py"}}}]},
    {"role": "tool", "content": "print(1/0)"},
    {"role": "assistant", "reasoning_content": "Division by zero.", "content": "The bug is a division by zero."},
    {"role": "user", "content": "Thanks. Now run the tests."},
    {"role": "assistant", "content": "Running them.",
     "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": {"command": "pytest"}}}]},
    {"role": "tool", "content": "1 passed"},
    {"role": "tool", "content": "done"},
]
# parallel tool calls and no system message (a template may refuse these: Llama 3.1 takes one call a turn)
PROBE_PARALLEL = [
    {"role": "user", "content": "List both folders."},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "bash", "arguments": {"command": "ls src"}}},
        {"type": "function", "function": {"name": "bash", "arguments": {"command": "ls tests"}}}]},
    {"role": "tool", "content": "a.py"},
    {"role": "tool", "content": "test_a.py"},
    {"role": "assistant", "content": "One module, one test."},
    {"role": "user", "content": "Good."},
]
PROBES = (PROBE, PROBE_PARALLEL)
PROBE_TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a command",
                                                  "parameters": {"type": "object",
                                                                 "properties": {"command": {"type": "string"}}}}}]


def conformance(template: ChatTemplate, messages: list[dict] | None = None, tools: list[dict] | None = None,
                encode: Callable[[str], list[int]] | None = None) -> dict:
    """Render `messages` (default `PROBE`) as the proxy does and say whether token-in/token-out
    capture is exact under this template.

    ``append_only``: for every assistant message, the prompt it was sampled from plus its text
    is a prefix of the whole conversation rendered later (fails where a template rewrites history,
    e.g. drops past reasoning). ``incremental_exact``: the per-message segments concatenate to
    the whole render; given `encode` (text -> ids as transformers tokenizes a rendered prompt),
    their ids, each segment tokenized on its own, equal the whole prompt's ids. ``refused``: the
    template raised on the conversation itself (the reason is in ``breaks``). ``breaks``: where
    any of these fails (message index, role, why)."""
    messages = PROBE if messages is None else messages
    tools = PROBE_TOOLS if tools is None else tools
    breaks: list[dict] = []
    try:
        whole = template.render(messages, tools)
        prompt = template.render(messages, tools, add_generation_prompt=True)
    except TemplateError as e:
        return {"append_only": False, "incremental_exact": False, "refused": True,
                "breaks": [{"message": None, "role": None, "why": str(e)}]}
    for a, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        try:
            before = template.render(messages[:a], tools, add_generation_prompt=True)
            turn = template.render(messages[: a + 1], tools)
        except TemplateError as e:
            breaks.append({"message": a, "role": "assistant", "why": str(e)})
            continue
        if not turn.startswith(before):
            breaks.append({"message": a, "role": "assistant",
                           "why": "the generation prompt is not how the template opens an assistant turn"})
        elif not whole.startswith(turn.rstrip()):  # the turn as sampled (trailing newlines are the template's)
            breaks.append({"message": a, "role": "assistant",
                           "why": "later messages change how this sampled turn renders (e.g. reasoning dropped)"})
    append_only = not breaks
    try:
        segs, gen = template.segments(messages, tools)
        if encode is None:
            incremental = "".join(segs) + gen == prompt
        else:
            incremental = [i for seg in segs + [gen] for i in encode(seg)] == encode(prompt)
        if not incremental:
            breaks.append({"message": None, "role": None,
                           "why": "per-message segments differ from the whole render"
                                  + (" by token ids" if encode is not None else "")})
    except TemplateError as e:
        incremental = False
        breaks.append({"message": None, "role": None, "why": str(e)})
    return {"append_only": append_only, "incremental_exact": incremental, "refused": False, "breaks": breaks}
