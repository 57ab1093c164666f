"""Issue 34, item 3: fair serving. One execution's burst is capped (429 with Retry-After beyond
`proxy.max_calls_in_flight`) and its calls carry falling priorities, which the engine admits
highest first (as SGLang with --enable-priority-scheduling): a sibling's first call goes ahead
of a burst's later ones. The engine is held on an event; nothing depends on timing."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from gyre.config import load_config
from gyre.engine.runtime import Engine
from gyre.engine.sampling import SamplingParams
from gyre.engine.sglang_launch import SGLangSpec
from gyre.model.tiny import ensure_tiny_model
from support.proxy_stack import Stack
from support.raw_http import raw_post


@pytest.fixture
def stack():
    s = Stack()
    yield s
    s.close()


def wait_for(cond, what: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_calls_over_the_cap_get_429_and_the_rest_carry_round_robin_priorities(stack):
    import urllib.request

    stack.proxy.gate.max_in_flight = 2
    stack.engine.gate = stack.lt.run(_event())
    _, k1 = stack.client("burst")
    _, k2 = stack.client("sibling")
    url = stack.base + "/v1/chat/completions"
    body = json.dumps({"model": "main", "messages": [{"role": "user", "content": "x"}]}).encode()
    got: dict = {}

    def call(name, key):
        got[name] = raw_post(url, body, key)

    threads = [threading.Thread(target=call, args=(f"burst{i}", k1)) for i in range(2)]
    for t in threads:
        t.start()
    wait_for(lambda: stack.engine.started == 2, "the burst's two calls at the engine")
    req = urllib.request.Request(url, data=body, method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {k1}"})
    try:
        urllib.request.urlopen(req, timeout=10)
        raise AssertionError("a third call in flight was accepted")
    except urllib.error.HTTPError as e:
        assert e.code == 429 and e.headers["Retry-After"] == "1"
        assert json.loads(e.read())["error"]["code"] == "too_many_calls_in_flight"
    threads.append(threading.Thread(target=call, args=("sibling", k2)))
    threads[-1].start()
    wait_for(lambda: stack.engine.started == 3, "the sibling's call at the engine")
    by_exec = {}
    for r in stack.engine.requests:
        by_exec.setdefault(r["rid"].rsplit("-", 1)[0], []).append(r["priority"])
    assert sorted(by_exec["burst"]) == [-1, 0] and by_exec["sibling"] == [0]
    stack.lt.run(_set(stack.engine.gate))
    for t in threads:
        t.join(30)
    assert {k: v[0] for k, v in got.items()} == {"burst0": 200, "burst1": 200, "sibling": 200}
    assert raw_post(url, body, k1)[0] == 200  # the slots are free again
    assert stack.proxy.gate.in_flight == {} and stack.proxy.gate.refused == 1


async def _event():
    return asyncio.Event()


async def _set(ev):
    ev.set()


@pytest.mark.slow
def test_the_engine_admits_the_highest_priority_first_and_in_order_within(tmp_path_factory):
    engine = Engine(ensure_tiny_model(tmp_path_factory.getbasetemp() / "tiny-qwen"), max_running=1)
    order, done = [], threading.Event()

    def on_done(name):
        def f(_res):
            order.append(name)
            if len(order) == 4:
                done.set()
        return f

    try:
        with engine._cv:  # the worker admits nothing until all four wait
            for name, prio in [("a", -1), ("b", None), ("c", -1), ("d", 0)]:
                engine.submit(name, [1, 2, 3], SamplingParams(max_new_tokens=2), on_done(name), priority=prio)
        assert done.wait(60)
    finally:
        engine.close()
    assert order == ["d", "a", "c", "b"]  # none given is the lowest, as in SGLang


def test_sglang_is_launched_with_priority_scheduling_and_the_cap_is_configured():
    assert "--enable-priority-scheduling" in SGLangSpec(model_path="/m").command("python")
    assert load_config(None, []).proxy.max_calls_in_flight == 8
    assert load_config(None, ["proxy.max_calls_in_flight=3"]).proxy.max_calls_in_flight == 3
