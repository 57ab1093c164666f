"""Per-call proxy work follows the call's new messages (issue 28, ARCHITECTURE.md invariant 10):
a call starts from the execution's last walk (gyre.proxy.capture.Walked) and, under an
append-only chat template, renders only the end of the conversation (template_capture._window).
Both must give exactly the ids of the full computation: the same harness conversation goes through
two proxies, one as shipped and one that forgets its walk after every call and renders whole
conversations, and the engine must receive the same input ids and the trees hold the same nodes."""

from __future__ import annotations

import json
import urllib.request

import pytest

from gyre.engine.router import Router
from gyre.model.chat_template import ChatTemplate
from gyre.proxy import template_capture
from gyre.proxy.body_cache import BodyCache
from gyre.proxy.capture import ExecutionSession, message_keys, prepare_call, record_call, remember
from gyre.proxy.chat import Message, parse_messages
from gyre.proxy.routes import create_app, start_site
from gyre.proxy.server import Proxy
from gyre.traj.record import ExecutionRecord
from support.loop_thread import LoopThread
from support.scripted_engine import ScriptedEngine
from support.chat_templates import TEMPLATES, TOOLS
from support.proxy_stack import R, TOKENIZER


def _call_text(i: int, reasoning: bool) -> str:
    think = f"<think>\nstep {i}: look around\n</think>\n\n" if reasoning else ""
    cmd = "ls" if i % 3 == 0 else f"cat mod_{i}.py"  # repeated calls: periodic text
    return think + '<tool_call>\n{"name": "bash", "arguments": {"command": "%s"}}\n</tool_call>' % cmd


class Pair:
    """Two proxies behind their own scripted engines, fed the same requests."""

    def __init__(self, template: str | None, history: str, reasoning: bool, force_window: bool):
        self.lt = LoopThread()
        kw = {} if template is None else {
            "chat_template": ChatTemplate((TEMPLATES / f"{template}.jinja").read_text()), "history": history,
            "reasoning_parser": "qwen3" if reasoning else "none"}
        self.engines = [ScriptedEngine(decode=R.decode), ScriptedEngine(decode=R.decode)]
        for e in self.engines:
            e.script = [R.encode(_call_text(i, reasoning)) + [R.im_end] for i in range(60)]
        self.proxies, self.ports, self.keys = [], [], []

        async def up():
            self.down = []
            for e in self.engines:
                erunner, eport = await start_site(e.app(), "127.0.0.1", 0)
                router = Router([f"http://127.0.0.1:{eport}"])
                proxy = Proxy(router, TOKENIZER, **kw)
                prunner, port = await start_site(create_app(proxy, admin_key="a"), "127.0.0.1", 0)
                self.proxies.append(proxy)
                self.ports.append(port)
                self.down += [prunner.cleanup, router.close, erunner.cleanup]

        self.lt.run(up())
        self.proxies[0].template_window = self.proxies[0].template_window or force_window
        self.proxies[1].template_window = False
        self.keys = [p.register("e", task="t") for p in self.proxies]

    def post(self, messages: list[dict]) -> dict:
        out = []
        for k, (port, key) in enumerate(zip(self.ports, self.keys)):
            body = json.dumps({"model": "main", "messages": messages, "tools": TOOLS}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body, method="POST",
                                         headers={"Content-Type": "application/json",
                                                  "Authorization": f"Bearer {key}"})
            with urllib.request.urlopen(req, timeout=30) as r:
                out.append(json.loads(r.read()))
            if k == 1:  # the reference forgets its walk, body and wire digits: every call walks, parses and keys all
                sess = self.proxies[1].by_id["e"]
                sess.walked, sess.body, sess.wire_path = None, BodyCache(), None
        return out[0]

    def close(self):
        async def down():
            for f in self.down:
                await f()
        self.lt.run(down())
        self.lt.close()


def _drive(pair: Pair, calls: int = 26) -> None:
    """An agent conversation with what breaks prefixes: two tool results at once, a user turn in
    the middle, a retry of the same request, a compaction that restarts the history."""
    system = {"role": "system", "content": "You are a coding agent."}
    task = {"role": "user", "content": "Fix the failing test in the repository."}
    messages = [system, task]
    for i in range(calls):
        msg = pair.post(messages)["choices"][0]["message"]
        if i == 7:  # a retry: the harness sends the same request again
            msg = pair.post(messages)["choices"][0]["message"]
        turn = {"role": "assistant", "content": msg["content"], "tool_calls": msg["tool_calls"]}
        if msg.get("reasoning_content"):
            turn["reasoning_content"] = msg["reasoning_content"]
        messages.append(turn)
        messages.append({"role": "tool", "tool_call_id": "c", "content": "ok" if i % 3 == 0 else f"line {i}\n" * 3})
        if i % 5 == 4:
            messages.append({"role": "tool", "tool_call_id": "d", "content": "ok"})
        if i == 11:
            messages.append({"role": "user", "content": "Also keep the old behaviour."})
        if i == 17:  # compaction: the history restarts from a summary
            messages = [system, task, {"role": "user", "content": "Summary: tests fixed up to step 17."}]


@pytest.mark.parametrize("template,history,reasoning,force_window", [
    (None, "exact", False, False),
    ("chatml_hermes", "exact", False, False),
    ("chatml_hermes", "template", False, False),
    # not append-only: the proxy renders it whole; forced to try the window, its check must see it
    ("chatml_drop_reasoning", "exact", True, True),
])
def test_incremental_calls_give_the_full_computations_ids(template, history, reasoning, force_window, monkeypatch):
    windows = []
    orig = template_capture._window
    monkeypatch.setattr(template_capture, "_window",
                        lambda *a: windows.append(orig(*a) is not None) or orig(*a))
    pair = Pair(template, history, reasoning, force_window)
    try:
        _drive(pair)
        got, want = (e.requests for e in pair.engines)
        assert len(got) == len(want) == 27
        for k, (a, b) in enumerate(zip(got, want)):
            assert a["input_ids"] == b["input_ids"], f"call {k}"
        trees = [p.by_id["e"].tree for p in pair.proxies]
        assert [(n.parent, n.key, n.tokens.tolist()) for n in trees[0].nodes] == \
               [(n.parent, n.key, n.tokens.tolist()) for n in trees[1].nodes]
        if template == "chatml_hermes":
            assert sum(windows) >= 10  # the late calls of each history rendered only their end
    finally:
        pair.close()


def test_a_call_parses_and_keys_only_its_new_messages(monkeypatch):
    """With the execution's earlier messages repeated, the proxy computes a key (hash of the
    message text) only for the messages the last call did not send."""
    counted = []
    orig = Message.key
    monkeypatch.setattr(Message, "key", lambda self, salt="": counted.append(1) or orig(self, salt))
    pair = Pair(None, "exact", False, False)
    try:
        messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        per_call = []
        for i in range(12):
            before = len(counted)
            msg = pair.post(messages)["choices"][0]["message"]
            per_call.append(len(counted) - before)
            messages += [{"role": "assistant", "content": msg["content"], "tool_calls": msg["tool_calls"]},
                         {"role": "tool", "tool_call_id": "c", "content": f"out {i}"}]
        # per call: the reference keys every message (2 + 2i), the shipped proxy its 2 new ones,
        # plus one key each for the reply both record
        assert per_call[0] == 2 * (2 + 1)
        assert per_call[1:] == [(2 + 2 * i + 1) + (2 + 1) for i in range(1, 12)]
    finally:
        pair.close()


def test_a_node_recorded_after_the_walk_takes_over():
    """Calls of one execution overlap: while a call runs, a retry of an earlier request samples the
    same text with other ids, and the tree's newest node for that message is what a fresh walk
    finds from then on; the kept walk must stop before it, or the next call would be built on
    the older ids."""
    sess = ExecutionSession(ExecutionRecord("e", "t", 0), "k")

    def prepare(raw, use_walk=True):
        messages = parse_messages(raw)
        keys = message_keys(messages, "")
        same = sess.walked.common(raw, "") if use_walk and sess.walked is not None else 0
        return raw, messages, keys, prepare_call(R, sess, messages, [], keys, same)

    def record(call, out):
        raw, messages, keys, prepared = call
        reply = Message("assistant", R.decode(out[:-1]))
        record_call(sess, prepared, reply, out, [-1.0] * len(out), agent_role="main", weight_version="0",
                    endpoint="x", finish_reason="stop", t_start=0.0)
        remember(sess, prepared, raw, "", 0, messages, keys, R.im_end)

    ids_a = R.encode("All done here.") + [R.im_end]
    ids_b = R.encode("All do") + R.encode("ne here.") + [R.im_end]  # same text, other ids
    assert R.decode(ids_a) == R.decode(ids_b) and ids_a != ids_b
    base = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    turn = base + [{"role": "assistant", "content": "All done here."}, {"role": "user", "content": "more"}]
    record(prepare(base), ids_a)
    record(prepare(turn), R.encode("Next.") + [R.im_end])
    running = prepare(turn + [{"role": "assistant", "content": "Next."}, {"role": "user", "content": "again"}])
    assert running[3].known == 4  # it started from the kept walk
    record(prepare(base), ids_b)  # the retry ends first: a sibling node with the same key
    record(running, R.encode("Last.") + [R.im_end])
    nxt = turn + [{"role": "assistant", "content": "Next."}, {"role": "user", "content": "again"},
                  {"role": "assistant", "content": "Last."}, {"role": "user", "content": "end"}]
    want = prepare(nxt, use_walk=False)[3].input_ids
    assert prepare(nxt)[3].input_ids == want
    assert want[len(prepare(base, use_walk=False)[3].input_ids):][:len(ids_b) - 1] == ids_b[:-1]


@pytest.mark.slow  # transformers and three model directories: ~25 s on 2 cores
@pytest.mark.parametrize("name", ["qwen2_5", "qwen3_coder", "llama3_1"])
def test_windowed_render_of_real_templates_equals_transformers(tmp_path, name, monkeypatch):
    """The append-only real templates (tests/templates/SOURCES) over a 16-call conversation, long
    enough that the later calls render only their window: every call's ids are transformers'."""
    from openai import OpenAI

    from support.template_fixtures import FIXTURES, TOOLS as REAL_TOOLS, Reference, model_dir, script, serve

    windows = []
    orig = template_capture._window
    monkeypatch.setattr(template_capture, "_window", lambda *a: windows.append(orig(*a) is not None) or orig(*a))
    f = FIXTURES[name]
    directory = model_dir(name, tmp_path / name)
    ref = Reference(directory)
    end = "<|eot_id|>" if f.llama else "<|im_end|>"
    turns = script(f)
    plan = turns[:1] + [(new, {**turn, "content": f"{turn['content']} ({k})"})
                        for k in range(4) for new, turn in turns[1:]]
    overrides = ["proxy.history=exact", f"proxy.tool_parser={f.tool_parser}", f"proxy.reasoning_parser={f.reasoning_parser}"]
    with serve(directory, overrides) as (proxy, engine, base_url):
        client = OpenAI(base_url=base_url, api_key=proxy.register("e1", task="t"), max_retries=0)
        messages: list[dict] = []
        for i, (new, turn) in enumerate(plan):
            messages += [{**m, "tool_call_id": f"call_{i}"} if m["role"] == "tool" else m for m in new]
            engine.script = [ref.sampled(messages, turn, end)]
            reply = client.chat.completions.create(model="main", messages=messages, tools=REAL_TOOLS)
            assert engine.requests[-1]["input_ids"] == ref.ids(messages), f"{name} call {i}"
            m = reply.choices[0].message
            echo: dict = {"role": "assistant", "content": m.content}
            if m.tool_calls:
                echo["tool_calls"] = [{"id": f"call_{i}_{k}", "type": "function",
                                       "function": {"name": t.function.name, "arguments": t.function.arguments}}
                                      for k, t in enumerate(m.tool_calls)]
            messages.append(echo)
    assert len(plan) == 17 and sum(windows) >= 5


class _CountingDict(dict):
    """A session's wire-digit cache that counts its look-ups (one per segment joined)."""

    def __init__(self, counter: list):
        super().__init__()
        self.counter = counter

    def get(self, key, default=None):
        self.counter.append(1)
        return super().get(key, default)


@pytest.mark.parametrize("template,history", [(None, "exact"), ("chatml_hermes", "exact"),
                                              ("chatml_hermes", "template")])
def test_per_call_work_does_not_grow_with_the_history(template, history, monkeypatch):
    """Issue 28: the proxy's per-call work follows the call's new messages, in both history modes.
    Counted, not timed, over a 40-call execution whose turns all have the same size: messages the
    body parse scans, characters the cheap bound and the inline decision walk, messages parsed,
    messages the chat template renders, segments whose wire digits are joined, segments the tree
    compares. The late calls (history 4x longer) must do no more of any than the early ones; the
    tools, the same on every call, are serialized and hashed once for the whole execution."""
    from gyre.model import chat_template
    from gyre.proxy import body, body_cache, capture, server
    from gyre.traj.tree import TrajectoryTree

    work: dict[str, list] = {k: [] for k in ("chars", "parsed", "rendered", "wire", "tree", "salted")}

    def counting(mod, name, what, size):
        real = getattr(mod, name)

        def f(*a, **k):
            out = real(*a, **k)
            work[what].append(size(a, k, out))
            return out
        monkeypatch.setattr(mod, name, f)

    for mod in (body, body_cache, server):  # text_chars: the characters walked, what it returns
        counting(mod, "text_chars", "chars", lambda a, k, out: out)
    counting(server, "parse_messages", "parsed", lambda a, k, out: len(out))
    counting(chat_template.ChatTemplate, "render", "rendered", lambda a, k, out: len(a[1]))
    counting(TrajectoryTree, "add_call", "tree", lambda a, k, out: len(a[1]) - (k["path"] or (0,))[0])
    counting(capture, "tools_salt", "salted", lambda a, k, out: 1)
    pair = Pair(template, history, False, False)
    sess = pair.proxies[0].by_id["e"]
    sess.wire = _CountingDict(work["wire"])
    proxy, port, key = pair.proxies[0], pair.ports[0], pair.keys[0]
    pair.engines[0].script = [R.encode('<tool_call>\n{"name": "bash", "arguments": {"command": "cat m%03d.py"}}\n'
                                       '</tool_call>' % i) + [R.im_end] for i in range(40)]
    try:
        messages = [{"role": "system", "content": "You are a coding agent."},
                    {"role": "user", "content": "Fix the failing test in the repository."}]
        per_call, scanned = [], []
        for i in range(40):
            before = {k: len(v) for k, v in work.items()}
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/chat/completions", method="POST",
                data=json.dumps({"model": "main", "messages": messages, "tools": TOOLS}).encode(),
                headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
            with urllib.request.urlopen(req, timeout=30) as r:
                msg = json.loads(r.read())["choices"][0]["message"]
            per_call.append({k: sum(v[before[k]:]) for k, v in work.items()})
            scanned.append(sess.body.scanned)
            messages += [{"role": "assistant", "content": msg["content"], "tool_calls": msg["tool_calls"]},
                         {"role": "tool", "tool_call_id": "c", "content": f"line {i:03d}\n" * 20}]
        assert len(proxy.by_id["e"].tree.calls) == 40 and len(messages) == 82
        assert scanned[0] == 2 and set(scanned[1:]) == {2}  # the body parse: the two new messages
        for what in work:
            early = max(c[what] for c in per_call[8:13])
            late = max(c[what] for c in per_call[-5:])
            assert late <= early, (what, [c[what] for c in per_call])
        assert per_call[-1]["rendered"] < 2 * len(messages) if template else per_call[-1]["rendered"] == 0
        assert sum(c["salted"] for c in per_call) == 1, [c["salted"] for c in per_call]
    finally:
        pair.close()


@pytest.mark.parametrize("template,force_window,offloaded", [
    (None, False, False), ("chatml_hermes", False, False),
    # its window does not hold (reasoning dropped from the history): each call renders it whole
    ("chatml_drop_reasoning", True, True)])
def test_a_long_execution_is_prepared_on_the_loop_only_where_its_calls_render_their_end(
        template, force_window, offloaded, monkeypatch):
    """The inline decision counts the characters a call may render and tokenize: past INLINE_CHARS
    in all, an execution whose calls render only their new messages stays on the loop, one whose
    calls render the whole conversation goes to the worker pool."""
    from gyre.proxy import server

    monkeypatch.setattr(server, "INLINE_CHARS", 4000)
    pair = Pair(template, "exact", True, force_window)
    to_pool = []
    real = pair.proxies[0].workers.run

    async def run(fn, *args):
        to_pool.append(1)
        return await real(fn, *args)

    monkeypatch.setattr(pair.proxies[0].workers, "run", run)
    try:
        messages = [{"role": "system", "content": "You are a coding agent."},
                    {"role": "user", "content": "Fix the failing test in the repository."}]
        for i in range(14):  # 14 tool outputs of 500 characters: 7,000 in all
            msg = pair.post(messages)["choices"][0]["message"]
            turn = {"role": "assistant", "content": msg["content"], "tool_calls": msg["tool_calls"]}
            if msg.get("reasoning_content"):
                turn["reasoning_content"] = msg["reasoning_content"]
            messages += [turn, {"role": "tool", "tool_call_id": "c", "content": f"{i:03d} " * 125}]
            if i % 3 == 2:  # a user turn: the reasoning of the turns before it drops out of the render
                messages.append({"role": "user", "content": "Go on."})
        assert (len(to_pool) > 0) == offloaded, to_pool
        got, want = (e.requests for e in pair.engines)
        assert [r["input_ids"] for r in got] == [r["input_ids"] for r in want]
    finally:
        pair.close()
