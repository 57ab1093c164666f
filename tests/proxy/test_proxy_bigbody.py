"""Issue 34, item 4: a big request body is parsed in a worker process, never on the proxy's event
loop. The parse is held at a named point (tests/support/held_parse.py) on multiprocessing events,
so no timing decides what these tests see."""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import queue
import threading

import pytest

from support.held_parse import held_parse
from support.proxy_stack import Stack
from support.raw_http import raw_post

# 300 KB in a bookkeeping field: a body over the proxy's big-body threshold with a short prompt
BIG = {"user": "u" * 300_000}


@pytest.fixture
def stack():
    s = Stack(max_body=8 << 20)
    yield s
    s.close()


@pytest.fixture
def held(stack):
    """The proxy's big bodies parsed by held_parse: (entered queue, release event)."""
    with multiprocessing.get_context("spawn").Manager() as m:
        entered, release = m.Queue(), m.Event()
        stack.proxy.parse_big_body = functools.partial(held_parse, entered, release)
        yield entered, release
        release.set()


def body(content: str, **extra) -> bytes:
    return json.dumps({"model": "main", "messages": [{"role": "user", "content": content}], **extra}).encode()


def chat(stack, key: str, data: bytes) -> tuple[int, bytes]:
    return raw_post(stack.base + "/v1/chat/completions", data, key)


def in_thread(fn, *args) -> tuple[threading.Thread, dict]:
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn(*args)))
    t.start()
    return t, out


def test_a_sibling_is_served_while_a_big_body_is_parsed_in_a_worker_process(stack, held):
    entered, release = held
    _, big_key = stack.client("big")
    _, sib_key = stack.client("sibling")
    t, got = in_thread(chat, stack, big_key, body("big hi", **BIG))
    tag, pid = entered.get(timeout=60)
    assert tag == "big" and pid != os.getpid()  # another process parses it
    status, _ = chat(stack, sib_key, body("hi"))  # on the loop, this call would wait for the parse
    held_meanwhile = t.is_alive()
    release.set()
    t.join(60)
    assert status == 200 and held_meanwhile
    assert got["r"][0] == 200, got["r"][1][:300]
    assert len(stack.tree("big").calls) == 1 and len(stack.tree("sibling").calls) == 1


def test_one_executions_big_bodies_queue_behind_its_own_never_a_siblings(stack, held):
    entered, release = held
    _, a_key = stack.client("a")
    _, b_key = stack.client("b")
    a1, _ = in_thread(chat, stack, a_key, body("a1 hi", **BIG))
    assert entered.get(timeout=60)[0] == "a1"
    a2, _ = in_thread(chat, stack, a_key, body("a2 hi", **BIG))
    holders = stack.proxy.workers._holders
    # a2 waits for a1 (its execution's turn); the check reads the loop's state on the loop
    stack.lt.run(_until(lambda: holders.get("a") == 2))
    b1, _ = in_thread(chat, stack, b_key, body("b1 hi", **BIG))
    assert entered.get(timeout=60)[0] == "b1"  # the sibling's body is parsed while a1 is still held
    with pytest.raises(queue.Empty):
        entered.get_nowait()  # a2 is not in a worker: a1 holds its execution's turn
    release.set()
    for t in (a1, a2, b1):
        t.join(60)
    assert entered.get(timeout=60)[0] == "a2"
    assert len(stack.tree("a").calls) == 2 and len(stack.tree("b").calls) == 1


async def _until(cond, timeout_s: float = 60) -> None:
    """Yield on the loop until ``cond()`` holds (each check runs between the loop's callbacks)."""
    import asyncio

    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0)


REFUSED = {  # each refused before rendering; the 400 must read the same from the worker as inline
    "utf-8": b'{"model": "main", "messages": [{"role": "user", "content": "\xff"}]}',
    "json": b'{"model": "main", "messages": [',
    "object": b'[1, 2, 3]',
    "huge integer": b'{"model": "main", "seed": ' + b"9" * 5000 + b"}",
    "recursion": b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    "deep field": json.dumps({"model": "main", "messages": [{"role": "user", "content": "hi"}],
                              "metadata": functools.reduce(lambda v, _: {"k": v}, range(80), {})}).encode(),
    "deep message": json.dumps({"model": "main", "messages": [
        {"role": "user", "content": functools.reduce(lambda v, _: [v], range(80), "hi")}]}).encode(),
    "lone surrogate": b'{"model": "main", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
    "over the bound": body("word " * 1_500_000),
    "role": json.dumps({"model": "subagent:\u0007", "messages": [{"role": "user", "content": "word " * 1_500_000}]}).encode(),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_refused_big_body_gets_the_same_400_as_one_parsed_on_the_loop(stack, case):
    _, key = stack.client()
    answers = []
    for threshold in (1 << 40, 0):  # on the loop, then in the worker process
        stack.proxy.big_body_bytes = threshold
        answers.append(chat(stack, key, REFUSED[case]))
    (status, inline), (_, worker) = answers
    assert status == 400 and json.loads(worker) == json.loads(inline), (inline[:300], worker[:300])
    assert stack.engine.requests == [] and not stack.tree().calls


def test_an_accepted_big_body_renders_as_it_does_parsed_on_the_loop(stack):
    _, inline_key = stack.client("inline")
    _, worker_key = stack.client("worker")
    data = body("hello " * 2_000, tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}], **BIG)
    stack.proxy.big_body_bytes = 1 << 40
    assert chat(stack, inline_key, data)[0] == 200
    stack.proxy.big_body_bytes = 0
    assert chat(stack, worker_key, data)[0] == 200
    inline, worker = stack.tree("inline"), stack.tree("worker")
    assert inline.call_input_ids(inline.calls[0]).tolist() == worker.call_input_ids(worker.calls[0]).tolist()
    assert inline.calls[0].n_input > 2_000
    assert stack.proxy.workers._parsers is not None


def test_the_worker_processes_end_with_the_server():
    s = Stack(max_body=8 << 20)
    _, key = s.client()
    s.proxy.big_body_bytes = 0
    assert chat(s, key, body("hi"))[0] == 200
    procs = list(s.proxy.workers._parsers._processes.values())
    assert procs and all(p.is_alive() for p in procs)
    s.close()
    assert s.proxy.workers._parsers is None and not any(p.is_alive() for p in procs)


def test_a_dead_worker_costs_one_call_a_503_and_the_next_gets_a_new_pool(stack):
    _, key = stack.client()
    stack.proxy.big_body_bytes = 0
    assert chat(stack, key, body("hi"))[0] == 200
    for p in list(stack.proxy.workers._parsers._processes.values()):
        p.kill()  # e.g. the kernel's OOM killer
        p.join(30)
    status, raw = chat(stack, key, body("hi"))
    err = json.loads(raw)["error"]
    assert status == 503 and err["type"] == "server_error" and "retry" in err["message"], err
    assert chat(stack, key, body("hi"))[0] == 200
    assert len(stack.tree().calls) == 2


def test_a_big_body_that_extends_the_last_one_is_parsed_on_the_loop_from_where_it_differs(stack, monkeypatch):
    """A growing execution's bodies pass big_body_bytes: the first big one is parsed in a worker
    process, which hands back where its messages end; each next one that adds at most
    big_body_bytes is parsed on the loop from there (gyre.proxy.body_cache), as parse_json would;
    one that rewrites its history goes to the worker again."""
    _, key = stack.client()
    to_worker = []
    real = stack.proxy.workers.parse

    async def parse(fn, raw, *args):
        to_worker.append(len(raw))
        return await real(fn, raw, *args)

    monkeypatch.setattr(stack.proxy.workers, "parse", parse)
    stack.proxy.big_body_bytes = 4000
    sess = stack.proxy.by_id["e1"]
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "hello " * 1000}]
    for i in range(4):
        status, raw = chat(stack, key, json.dumps({"model": "main", "messages": messages}).encode())
        assert status == 200, raw[:300]
        assert len(to_worker) == 1 and sess.body.scanned == 2  # the first by the worker, then the 2 new ones
        messages += [{"role": "assistant", "content": json.loads(raw)["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"go on {i} ü"}]
    messages[1] = {"role": "user", "content": "bye " * 1000}  # the history rewritten: all of it is new
    assert chat(stack, key, json.dumps({"model": "main", "messages": messages}).encode())[0] == 200
    assert len(to_worker) == 2
    calls = stack.tree().calls
    assert len(calls) == 5 and [stack.tree().call_input_ids(c).tolist() for c in calls[:4]] == \
           [r["input_ids"] for r in stack.engine.requests[:4]]
