"""The proxy against the real `openai` client, over real HTTP, with a scripted engine behind the
real router (outputs chosen by the test) — plus one end-to-end run on the embedded engine."""

from __future__ import annotations

import json

import numpy as np
import pytest
from openai import OpenAI

from gyre.engine.router import Router
from gyre.proxy.routes import create_app, start_site
from gyre.proxy.server import Proxy
from support.loop_thread import LoopThread
from support.proxy_stack import post, R, Stack, TOKENIZER, TOOLS


@pytest.fixture
def stack():
    s = Stack()
    yield s
    s.close()


def test_plain_chat_records_exact_input_ids(stack):
    client, _ = stack.client()
    resp = client.chat.completions.create(model="main", messages=[
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}])
    assert resp.choices[0].message.content == "Hello from the model."
    assert resp.choices[0].finish_reason == "stop"
    sent = stack.engine.requests[-1]["input_ids"]
    expected = R.encode("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nSay hello."
                        "<|im_end|>\n<|im_start|>assistant\n")
    assert sent == expected  # rendering segment by segment equals whole-template tokenization
    tree = stack.tree()
    call = tree.calls[0]
    assert tree.call_input_ids(call).tolist() == sent
    assert tree.call_output_ids(call).tolist() == stack.engine.script[0]
    assert resp.usage.prompt_tokens == len(sent)


def test_tools_round_trip_reuses_generated_ids(stack):
    call_ids = R.encode('<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>') + [R.im_end]
    final = R.encode("Done: two files.") + [R.im_end]
    stack.engine.script = [call_ids, final]
    client, _ = stack.client()
    msgs = [{"role": "system", "content": "agent"}, {"role": "user", "content": "list files"}]
    r1 = client.chat.completions.create(model="main", messages=msgs, tools=TOOLS)
    m1 = r1.choices[0].message
    assert r1.choices[0].finish_reason == "tool_calls"
    assert m1.tool_calls[0].function.name == "bash"
    assert json.loads(m1.tool_calls[0].function.arguments) == {"command": "ls -la"}
    msgs += [m1.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": m1.tool_calls[0].id, "content": "a.py\nb.py"}]
    r2 = client.chat.completions.create(model="main", messages=msgs, tools=TOOLS)
    assert r2.choices[0].message.content == "Done: two files."
    first, second = stack.engine.requests[-2]["input_ids"], stack.engine.requests[-1]["input_ids"]
    assert second[: len(first) + len(call_ids)] == first + call_ids  # exact prefix incl. sampled ids
    tree = stack.tree()
    assert len(tree.calls) == 2
    assert tree.calls[0].leaf in tree.path(tree.calls[1].leaf)  # call 2 extends call 1's path
    assert tree.stats().leaves == 1


def test_token_truth_with_non_canonical_output(stack):
    # the engine "samples" one token per character: decoding then re-encoding gives other ids
    text = "the result is fine"
    per_char = [TOKENIZER.token_to_id(c if c != " " else "Ġ") for c in text]
    assert None not in per_char
    out = per_char + [R.im_end]
    assert R.encode(text) != per_char, "precondition: re-encoding must differ"
    stack.engine.script = [out, R.encode("ok") + [R.im_end]]
    client, _ = stack.client()
    msgs = [{"role": "user", "content": "go"}]
    r1 = client.chat.completions.create(model="main", messages=msgs)
    assert r1.choices[0].message.content == text
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "next"}]
    client.chat.completions.create(model="main", messages=msgs)
    second = stack.engine.requests[-1]["input_ids"]
    first = stack.engine.requests[-2]["input_ids"]
    assert second[len(first): len(first) + len(out)] == out
    assert R.encode(text) not in [second[i:i + len(R.encode(text))] for i in range(len(second))]


def test_streaming_matches_non_streaming(stack):
    stack.engine.script = [R.encode('Let me check.\n<tool_call>\n{"name": "bash", "arguments": {"command": "pwd"}}\n</tool_call>') + [R.im_end]]
    client, _ = stack.client()
    chunks = list(client.chat.completions.create(model="main", messages=[{"role": "user", "content": "where?"}],
                                                 tools=TOOLS, stream=True, stream_options={"include_usage": True}))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert content == "Let me check."
    assert calls[0].function.name == "bash" and json.loads(calls[0].function.arguments) == {"command": "pwd"}
    assert finish == ["tool_calls"]
    assert chunks[-1].usage.completion_tokens == len(stack.engine.script[0])
    assert len(stack.tree().calls) == 1


def test_unreadable_tool_call_is_plain_content(stack):
    stack.engine.script = [R.encode("<tool_call>\n{not json at all\n</tool_call>") + [R.im_end]]
    client, _ = stack.client()
    r = client.chat.completions.create(model="main", messages=[{"role": "user", "content": "x"}], tools=TOOLS)
    assert r.choices[0].finish_reason == "stop"
    assert "not json" in r.choices[0].message.content
    assert not r.choices[0].message.tool_calls


def test_roles_from_model_name_and_header(stack):
    client, key = stack.client()
    client.chat.completions.create(model="subagent:explorer", messages=[{"role": "user", "content": "a"}])
    client.chat.completions.create(model="compactor", messages=[{"role": "user", "content": "b"}])
    client.chat.completions.create(model="gpt-whatever", messages=[{"role": "user", "content": "c"}])
    client.chat.completions.create(model="gpt-whatever", messages=[{"role": "user", "content": "d"}],
                                   extra_headers={"X-Gyre-Role": "subagent:tester"})
    assert [c.agent_role for c in stack.tree().calls] == ["subagent:explorer", "compactor", "main", "subagent:tester"]


def test_compaction_branches_without_rewriting(stack):
    client, _ = stack.client()
    sys_msg = {"role": "system", "content": "agent"}
    long = [sys_msg, {"role": "user", "content": "task"}]
    for i in range(3):
        r = client.chat.completions.create(model="main", messages=long)
        long += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": f"obs {i}"}]
    tree = stack.tree()
    before = [(n.id, n.parent, n.tokens.copy()) for n in tree.nodes]
    client.chat.completions.create(model="compactor", messages=long + [{"role": "user", "content": "summarise"}])
    client.chat.completions.create(model="main", messages=[sys_msg, {"role": "user", "content": "task\nsummary: ..."}])
    for nid, parent, toks in before:
        assert tree.nodes[nid].parent == parent and np.array_equal(tree.nodes[nid].tokens, toks)
    st = tree.stats()
    assert st.leaves == 2  # the compactor's path and the restarted main conversation
    assert st.expanded_nodes > st.unique_nodes  # the system prompt is shared


def test_stop_string_truncates_tokens_and_text(stack):
    stack.engine.script = [R.encode("alpha beta STOP gamma") + [R.im_end]]
    client, _ = stack.client()
    r = client.chat.completions.create(model="main", messages=[{"role": "user", "content": "x"}], stop=["STOP"])
    assert r.choices[0].message.content == "alpha beta "
    out = stack.tree().call_output_ids(stack.tree().calls[0]).tolist()
    assert out == stack.engine.script[0][: len(out)] and len(out) < len(stack.engine.script[0])
    assert "STOP" in R.decode(out)


def test_auth_missing_unknown_and_revoked(stack):
    url = stack.base + "/v1/chat/completions"
    body = json.dumps({"model": "main", "messages": [{"role": "user", "content": "x"}]}).encode()
    assert post(url, body, None)[0] == 401
    assert post(url, body, "gyre-not-a-key")[0] == 401
    _, key = stack.client("e2")
    assert post(url, body, key)[0] == 200
    stack.proxy.end("e2")
    status, err = post(url, body, key)
    assert status == 401 and "revoked" in err["error"]["message"]
    assert post(stack.base + "/gyre/executions", b'{"execution_id": "x"}', "wrong")[0] == 401
    status, reg = post(stack.base + "/gyre/executions", b'{"execution_id": "e3"}', "admin-secret")
    assert status == 200 and post(url, body, reg["api_key"])[0] == 200


@pytest.mark.parametrize("payload,ctype,status,needle", [
    (b"{not json", "application/json", 400, "not valid JSON"),
    (b"\xff\xfe\x00garbage", "application/json", 400, "UTF-8"),
    (b"[1, 2]", "application/json", 400, "JSON object"),
    (json.dumps({"messages": "hi"}).encode(), "application/json", 400, "messages"),
    (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), "application/json", 400, "role"),
    (json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), "application/json", 400, "content"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}).encode(), "application/json", 400, "temperature"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 3}).encode(), "application/json", 400, "n=1"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": -4}).encode(), "application/json", 400, "max_tokens"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "tools": {"a": 1}}).encode(), "application/json", 400, "tools"),
    (json.dumps({"messages": [{"role": "user", "content": "x" * 100_000}]}).encode(), "application/json", 413, "limit"),
])
def test_bad_input_gets_clear_4xx_and_server_keeps_serving(stack, payload, ctype, status, needle):
    _, key = stack.client()
    got, err = post(stack.base + "/v1/chat/completions", payload, key, ctype)
    assert got == status, err
    assert needle in err["error"]["message"]
    ok, resp = post(stack.base + "/v1/chat/completions",
                    json.dumps({"model": "main", "messages": [{"role": "user", "content": "still there?"}]}).encode(), key)
    assert ok == 200 and resp["choices"][0]["message"]["content"]
    assert len(stack.tree().calls) == 1  # the bad request recorded nothing


def test_unknown_route_is_404_json(stack):
    status, err = post(stack.base + "/v1/completions", b"{}", None)
    assert status == 404 and "no route" in err["error"]["message"]


def test_models_lists_roles(stack):
    client, _ = stack.client()
    ids = [m.id for m in client.models.list().data]
    assert "main" in ids


def test_end_to_end_on_embedded_engine(tmp_path):
    """The real engine subprocess behind the proxy: behaviour log-probs and versions recorded."""
    from gyre.engine.launch import start_engine
    from gyre.model.tiny import ensure_tiny_model
    from gyre.model.tokenizer import load_tokenizer

    model = ensure_tiny_model(tmp_path / "tiny")
    lt = LoopThread()
    with start_engine(model_dir=model, extra_args=["--no-api-key"]) as eng:
        async def up():
            router = Router([eng.url])
            proxy = Proxy(router, load_tokenizer(model))
            runner, port = await start_site(create_app(proxy, admin_key="a"), "127.0.0.1", 0)
            return router, proxy, runner, port
        router, proxy, runner, port = lt.run(up())
        try:
            key = proxy.register("live")
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
            msgs = [{"role": "user", "content": "hello"}]
            r = client.chat.completions.create(model="main", messages=msgs, max_tokens=12, temperature=1.0)
            msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
            chunks = list(client.chat.completions.create(model="main", messages=msgs, max_tokens=12, stream=True))
            assert chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")
            tree = proxy.by_id["live"].tree
            assert len(tree.calls) == 2
            c0, c1 = tree.calls
            out0 = tree.call_output_ids(c0).tolist()
            in1 = tree.call_input_ids(c1).tolist()
            in0 = tree.call_input_ids(c0).tolist()
            assert in1[: len(in0) + len(out0)] == in0 + out0
            leaf = tree.nodes[c0.leaf]
            assert len(leaf.logprobs) == len(out0) and np.all(leaf.logprobs <= 0)
            assert c0.weight_version == c1.weight_version and c0.endpoint == eng.url
        finally:
            lt.run(runner.cleanup())
            lt.run(router.close())
            lt.close()
