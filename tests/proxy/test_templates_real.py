"""Real chat templates (tests/templates/SOURCES) through the real proxy, compared by token ids
with transformers' ``apply_chat_template`` (tests/support/template_fixtures.py drives a 5-call agent:
system message, parallel tool calls, reasoning, a new user turn). Each named failure of issue 29
item 1 is a case here: Qwen3-Coder's ``<|im_end|>`` split by a character cut, cuts inside
``<tool_call>``/``<think>`` in template mode, Qwen3.5's "No user query found" on a system-only
prefix, a Llama 3 directory (no ChatML tokens) refused, and a template Gyre cannot follow exactly
refused at start."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI

from gyre.model.chat_template import ChatTemplate, TemplateError, end_token_ids
from gyre.model.parsers import parse
from gyre.model.tokenizer import load_tokenizer
from gyre.proxy.capture import ExecutionSession, Renderer
from gyre.proxy.chat import MessageError, parse_messages
from gyre.proxy.template_capture import TemplateRefused, check_template, prepare_call_template
from gyre.traj.record import ExecutionRecord
from support.template_fixtures import FIXTURES, TOOLS, Reference, drive, model_dir, serve

APPEND_ONLY = ("qwen2_5", "qwen3_coder", "llama3_1")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: model_dir(name, root / name) for name in FIXTURES}


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_every_call_equals_transformers_in_template_mode(dirs, name):
    calls = drive(dirs[name], name, history="template")
    assert len(calls) == 5 and [c.error for c in calls] == [None] * 5
    for i, c in enumerate(calls):
        assert c.proxy_ids == c.reference_ids, f"{name} call {i}"


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_exact_mode_trains_what_was_sampled(dirs, name):
    """The default history mode, every template: each call's prompt and sampled output are a prefix
    of the next call's prompt (templates that drop past reasoning included: the sampled turn stays),
    and where the template is append-only, the stored and sampled ids reused are still exactly
    transformers' ids."""
    calls = drive(dirs[name], name, history="exact")
    assert len(calls) == 5
    for a, b in zip(calls, calls[1:]):
        seen = a.proxy_ids + a.output_ids
        assert b.proxy_ids[: len(seen)] == seen
    if name in APPEND_ONLY:
        assert [c.proxy_ids == c.reference_ids for c in calls] == [True] * 5


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5"])
def test_template_mode_equals_transformers_when_the_harness_drops_reasoning(dirs, name):
    """A harness that does not send reasoning_content back: the template renders its turns without
    it, and the engine still gets exactly transformers' ids (the tree branches where the sampled
    turn and its rewrite differ: each target keeps the context it was sampled from)."""
    calls = drive(dirs[name], name, history="template", echo_reasoning=False)
    assert [c.proxy_ids == c.reference_ids for c in calls] == [True] * 5


def _renderer(directory) -> Renderer:
    tok = load_tokenizer(directory)
    return Renderer(tok, end_token_ids(directory, tok.token_to_id))


def _session() -> ExecutionSession:
    return ExecutionSession(ExecutionRecord("e", "t", 0), "k")


def _agent_messages() -> list[dict]:
    return [{"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "List the files."},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]},
            {"role": "tool", "content": "a.py"}]


def test_qwen3_coder_never_splits_im_end(dirs):
    """Main cut segments at a character common prefix: after a tool result ``<|im_end|>`` (end of
    the tool turn) and ``<|im_start|>`` (the generation prompt) share ``<|im_``, and the end token
    reached the engine as six ordinary tokens."""
    d = dirs["qwen3_coder"]
    r = _renderer(d)
    t = ChatTemplate.from_dir(d)
    check_template(r, t)
    msgs = _agent_messages()
    ids = prepare_call_template(r, t, _session(), parse_messages(msgs), TOOLS, "exact").input_ids
    assert ids == Reference(d).ids(msgs)
    assert ids.count(r.im_end) == 4  # system, user, assistant, tool turns: each closed by the one token


@pytest.mark.parametrize("name", ["qwen3", "qwen3_6"])
def test_no_cut_inside_tool_call_or_think_in_template_mode(dirs, name):
    """Every segment the proxy stores (and the prompt after them: a turn the template may still
    rewrite stays there) begins and ends on a token boundary: re-tokenizing a piece alone gives its
    own ids, and ``<tool_call>``/``<think>`` are single tokens in the ids sent."""
    d = dirs[name]
    r = _renderer(d)
    t = ChatTemplate.from_dir(d)
    check_template(r, t)
    msgs = _agent_messages()
    msgs[2]["reasoning_content"] = "look first"
    prepared = prepare_call_template(r, t, _session(), parse_messages(msgs), TOOLS, "template")
    pieces = [[int(i) for i in s.tokens] for s in prepared.segments] + [list(prepared.prompt_tokens)]
    assert len([p for p in pieces if p]) >= 3
    for piece in pieces:
        assert r.encode(r.decode(piece)) == piece
    sent = prepared.input_ids
    for token in ("<tool_call>", "<think>", "</think>", "</tool_call>"):
        assert sent.count(r.tok.token_to_id(token)) == r.decode(sent).count(token) > 0
    assert prepared.input_ids == Reference(d).ids(msgs)


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_6"])
def test_a_system_message_is_served_where_the_template_refuses_it_alone(dirs, name):
    """Qwen3.5/3.6 raise "No user query found" on a system message alone (the prefix main rendered):
    every request with a system message was a 500. A conversation the template itself refuses is
    the client's 400, with the template's reason."""
    d = dirs[name]
    t = ChatTemplate.from_dir(d)
    with pytest.raises(TemplateError, match="No user query found"):
        t.render(_agent_messages()[:1], TOOLS)
    r = _renderer(d)
    check_template(r, t)
    msgs = _agent_messages()
    assert prepare_call_template(r, t, _session(), parse_messages(msgs), TOOLS).input_ids == Reference(d).ids(msgs)
    with pytest.raises(MessageError, match="No user query found"):
        prepare_call_template(r, t, _session(), parse_messages(msgs[:1]), TOOLS)


def test_llama3_directory_is_served_with_its_own_end_tokens(dirs):
    """A Llama 3 directory has no ChatML tokens: main refused it ("tokenizer has no <|im_end|>").
    End-of-turn ids come from generation_config.json; the built-in ChatML renderer still refuses."""
    d = dirs["llama3_1"]
    tok = load_tokenizer(d)
    assert tok.token_to_id("<|im_end|>") is None
    r = _renderer(d)
    ids = {tok.token_to_id(t) for t in ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")}
    assert set(r.stop_ids()) == ids
    assert r.decode_output(tok.encode("Done.").ids + [tok.token_to_id("<|eot_id|>")]) == "Done."
    with pytest.raises(ValueError, match="built-in renderer writes ChatML"):
        r.require_chatml()
    out = parse('<|python_tag|>{"name": "bash", "parameters": {"command": "ls"}}', "llama3")
    assert out.content is None and [(c.name, c.arguments) for c in out.tool_calls] == [("bash", {"command": "ls"})]
    assert parse('{"name": "bash"', "llama3").tool_calls == []  # unreadable: all content
    # through the proxy, streamed and not: the end token ends the turn, it is not content
    with serve(d, ["proxy.tool_parser=llama3"]) as (proxy, engine, base_url):
        engine.script = [tok.encode("All done.").ids + [tok.token_to_id("<|eot_id|>")]]
        msgs = [{"role": "user", "content": "Done?"}]
        whole = OpenAI(base_url=base_url, api_key=proxy.register("e1"), max_retries=0).chat.completions.create(
            model="m", messages=msgs)
        assert (whole.choices[0].message.content, whole.choices[0].finish_reason) == ("All done.", "stop")
        chunks = OpenAI(base_url=base_url, api_key=proxy.register("e2"), max_retries=0).chat.completions.create(
            model="m", messages=msgs, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "All done."
        assert set(engine.requests[-1]["sampling_params"]["stop_token_ids"]) == set(r.stop_ids())


def test_a_template_gyre_cannot_follow_is_refused_at_start(tmp_path, dirs):
    """An added token that swallows the whitespace after it (rstrip) makes segments tokenized one
    by one differ from the whole prompt's ids (a segment ends at ``<|im_end|>``, the ``\n`` after it
    opens the next): refused at start, by ids, with the reason."""
    d = model_dir("qwen2_5", tmp_path / "rstrip")
    spec = json.loads((d / "tokenizer.json").read_text())
    for t in spec["added_tokens"]:
        if t["content"] == "<|im_end|>":
            t["rstrip"] = True
    (d / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(TemplateRefused, match="by token ids"):
        check_template(_renderer(d), ChatTemplate.from_dir(d))
    with pytest.raises(TemplateRefused, match="renders none of Gyre's probe"):
        check_template(_renderer(dirs["qwen2_5"]), ChatTemplate("{{ raise_exception('images only') }}"))
