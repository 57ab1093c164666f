"""Replay-resume at the proxy: a resumed execution's requests that equal recorded calls are
answered from the recording (same tokens, log-probs, version; no engine request), streamed as a
live call is; the first request that differs goes live and branches the tree. Real proxy, real
router, real `openai` client over HTTP; the engine is the scripted one (outputs chosen here)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gyre.proxy.replay import REPLAY_ENDPOINT
from support.proxy_stack import R, TOOLS, Stack

CALL = R.encode('<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>') + [R.im_end]
FINAL = R.encode("Done: two files.") + [R.im_end]
LIVE = R.encode("A new answer from the live engine.") + [R.im_end]


@pytest.fixture
def stack():
    s = Stack()
    yield s
    s.close()


def episode(client, first_user: str = "list files", stream_second: bool = True) -> tuple[list[dict], list[str]]:
    """What a harness does: a tool call, its result, then a streamed final answer."""
    msgs = [{"role": "system", "content": "agent"}, {"role": "user", "content": first_user}]
    r1 = client.chat.completions.create(model="main", messages=msgs, tools=TOOLS)
    m1 = r1.choices[0].message
    msgs += [m1.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": m1.tool_calls[0].id, "content": "a\nb"}]
    r2 = client.chat.completions.create(model="main", messages=msgs, tools=TOOLS, stream=stream_second)
    if stream_second:
        text = "".join(c.choices[0].delta.content or "" for c in r2 if c.choices)
    else:
        text = r2.choices[0].message.content
    msgs.append({"role": "assistant", "content": text})
    return msgs, [json.dumps(m1.tool_calls[0].function.model_dump()), text]


def without_ids(msgs: list[dict]) -> str:
    """Messages as the model sees them (tool-call ids are fresh on every answer and never render)."""
    text = json.dumps(msgs)
    import re
    return re.sub(r'"(tool_call_id|id)": "call_[0-9a-f]+"', "", text)


def recorded(stack, eid: str, status: str = "stopped"):
    return stack.lt.run(_end(stack.proxy, eid, status))


async def _end(proxy, eid, status):
    return proxy.end(eid, status)


def test_replay_answers_recorded_calls_from_the_tree_then_branches_live(stack):
    stack.engine.script, stack.engine.weight_version = [CALL, FINAL], "3"
    client, _ = stack.client("q-g0-a0")
    msgs, answers = episode(client)
    first = recorded(stack, "q-g0-a0")  # the run was stopped here (preemption)
    n_engine = len(stack.engine.requests)
    assert n_engine == 2 and len(first.tree.calls) == 2

    # the engine now has new weights and would answer otherwise: replayed calls must not reach it
    stack.engine.script, stack.engine.weight_version = [LIVE], "4"
    key = stack.proxy.register("q-g0-a1", task="t", group=0, replay=first.tree)
    from openai import OpenAI
    again = OpenAI(base_url=stack.base + "/v1", api_key=key, max_retries=0)
    msgs2, answers2 = episode(again)
    assert answers2 == answers and without_ids(msgs2) == without_ids(msgs)  # the harness sees what it saw
    assert len(stack.engine.requests) == n_engine  # no engine time
    sess = stack.proxy.by_id["q-g0-a1"]
    assert (sess.replay.replayed, sess.replay.active) == (2, True)

    # the recording ends here: the next request goes live and branches the same tree
    msgs2.append({"role": "user", "content": "now add a test"})
    live = again.chat.completions.create(model="main", messages=msgs2, tools=TOOLS)
    assert live.choices[0].message.content == "A new answer from the live engine."
    assert len(stack.engine.requests) == n_engine + 1
    assert not sess.replay.active and not sess.replay.diverged  # it ran out, it did not diverge
    resumed = recorded(stack, "q-g0-a1", "done")
    t0, t1 = first.tree, resumed.tree
    for a, b in zip(t0.calls, t1.calls):  # replayed calls: token truth, versions and all
        assert np.array_equal(t0.call_input_ids(a), t1.call_input_ids(b))
        assert np.array_equal(t0.call_output_ids(a), t1.call_output_ids(b))
        assert np.array_equal(t0.nodes[a.leaf].logprobs, t1.nodes[b.leaf].logprobs)
        assert (b.weight_version, b.policy_version, b.endpoint) == ("3", 3, REPLAY_ENDPOINT)
        assert b.finish_reason == a.finish_reason
    third = t1.calls[2]
    assert third.weight_version == "4" and third.endpoint != REPLAY_ENDPOINT
    assert t1.calls[1].leaf in t1.path(third.leaf)  # the live call continues the replayed path


def test_replay_of_a_harness_with_a_timestamp_in_its_prompt_diverges_at_its_first_call(stack):
    """A harness whose prompt differs on every start (a clock in its system prompt) cannot be
    replayed: its first request matches nothing, goes live, and nothing else is replayed."""
    stack.engine.script = [CALL, FINAL]
    client, _ = stack.client("t-g0-a0")
    episode(client, first_user="list files (it is 09:00:01)")
    first = recorded(stack, "t-g0-a0")
    stack.engine.script = [CALL, FINAL]
    key = stack.proxy.register("t-g0-a1", task="t", group=0, replay=first.tree)
    from openai import OpenAI
    n = len(stack.engine.requests)
    episode(OpenAI(base_url=stack.base + "/v1", api_key=key, max_retries=0), first_user="list files (it is 11:42:17)")
    sess = stack.proxy.by_id["t-g0-a1"]
    assert (sess.replay.replayed, sess.replay.diverged) == (0, True)
    assert len(stack.engine.requests) == n + 2  # both calls generated live
    assert all(c.endpoint != REPLAY_ENDPOINT for c in sess.tree.calls)


def test_replay_streams_a_recorded_call_token_by_token(stack):
    stack.engine.script = [CALL, FINAL]
    client, _ = stack.client("s-g0-a0")
    episode(client, stream_second=False)
    first = recorded(stack, "s-g0-a0")
    key = stack.proxy.register("s-g0-a1", task="t", group=0, replay=first.tree)
    from openai import OpenAI
    again = OpenAI(base_url=stack.base + "/v1", api_key=key, max_retries=0)
    msgs = [{"role": "system", "content": "agent"}, {"role": "user", "content": "list files"}]
    r1 = again.chat.completions.create(model="main", messages=msgs, tools=TOOLS)
    m1 = r1.choices[0].message
    msgs += [m1.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": m1.tool_calls[0].id, "content": "a\nb"}]
    chunks = list(again.chat.completions.create(model="main", messages=msgs, tools=TOOLS, stream=True))
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(deltas) == "Done: two files." and len(deltas) > 1  # streamed, not one blob
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert stack.proxy.by_id["s-g0-a1"].replay.replayed == 2
