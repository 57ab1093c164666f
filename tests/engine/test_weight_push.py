"""A weight push is invisible to harnesses (ARCHITECTURE.md invariant 7).

Gyre pushes with ``update_weights_from_disk`` and ``abort_all_requests = false``. In SGLang that
takes the tokenizer manager's ``model_update_lock`` as writer, while every ``generate_request``
holds it as reader until its last response: running calls finish on the old weights, new ones
wait, none is aborted. The embedded engine does the same. So a call never spans a push, and the
version recorded with each call is the one that produced all of its tokens.

Here: 16 streaming executions through the real proxy, router and embedded engine subprocess,
10 pushes while they run. No harness sees an abort, an error event or a stream without its end;
every recorded call's version is consistent with when the pushes happened."""

from __future__ import annotations

import json
import threading
import time

import pytest
from openai import OpenAI

from gyre.engine.launch import start_engine
from gyre.engine.router import Router
from gyre.engine.sglang_api import SGLangAdmin
from gyre.model.tiny import ensure_tiny_model
from gyre.model.tokenizer import load_tokenizer
from gyre.proxy.routes import create_app, start_site
from gyre.proxy.server import Proxy
from support.loop_thread import LoopThread

EXECUTIONS, PUSHES = 16, 10


@pytest.mark.slow
def test_weight_push_is_invisible_to_16_streaming_executions(tmp_path):
    model = ensure_tiny_model(tmp_path / "tiny")
    lt = LoopThread()
    with start_engine(model_dir=model, api_key="engine-key", extra_args=["--weight-version", "0"]) as eng:
        async def up():
            router = Router([eng.url], api_key="engine-key")
            proxy = Proxy(router, load_tokenizer(model))
            runner, port = await start_site(create_app(proxy, admin_key="a"), "127.0.0.1", 0)
            return router, proxy, runner, port
        router, proxy, runner, port = lt.run(up())
        pushes: list[tuple[float, float]] = []  # (began, done) of push k+1
        pushing = threading.Event()
        problems: list[str] = []
        keys = {f"e{i}": proxy.register(f"e{i}") for i in range(EXECUTIONS)}

        def harness(eid: str) -> None:
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=keys[eid], max_retries=0)
            msgs = [{"role": "user", "content": f"task {eid}"}]
            calls = 0
            while calls < 2 or len(pushes) < PUSHES:  # keep calling until every push happened
                raw = client.chat.completions.with_raw_response.create(
                    model="main", messages=msgs[-3:], max_tokens=24, temperature=1.0, stream=True)
                text, finish, lines = "", None, raw.http_response.iter_lines()
                events = [line for line in lines if line.startswith("data: ")]
                for ev in events[:-1]:
                    body = json.loads(ev[6:])
                    if "error" in body:
                        problems.append(f"{eid}: error event {body['error']}")
                        continue
                    for ch in body["choices"]:
                        text += ch["delta"].get("content") or ""
                        finish = ch.get("finish_reason") or finish
                if events[-1] != "data: [DONE]" or finish not in ("stop", "length", "tool_calls"):
                    problems.append(f"{eid}: stream ended without its end ({events[-1][:80]}, finish {finish})")
                msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]
                calls += 1
                pushing.set()

        threads = [threading.Thread(target=harness, args=(f"e{i}",)) for i in range(EXECUTIONS)]
        for t in threads:
            t.start()
        pushing.wait(60)
        admin = SGLangAdmin(eng.url, "engine-key", timeout_s=120)
        for k in range(1, PUSHES + 1):
            began = time.time()
            admin.update_weights_from_disk(str(model), str(k))  # what a cell agent sends on a push
            pushes.append((began, time.time()))
        for t in threads:
            t.join(240)
        try:
            assert not problems, problems[:5]
            assert proxy.abandoned == {}, proxy.abandoned  # no call aborted, none lost
            calls = [(eid, c) for eid in keys for c in proxy.by_id[eid].tree.calls]
            assert len(calls) >= 2 * EXECUTIONS
            assert all(c.finish_reason in ("stop", "length") for _, c in calls)
            versions = {c.policy_version for _, c in calls}
            assert len(versions) > 2  # calls really ran through the pushes
            for eid, c in calls:
                v = c.policy_version
                assert str(v) == c.weight_version and 0 <= v <= PUSHES
                if v >= 1:  # produced by version v: it ended after v was installed ...
                    assert c.t_end >= pushes[v - 1][1] - 1e-3, (eid, c.index, v)
                if v < PUSHES:  # ... and it had arrived before v + 1 was
                    assert c.t_start <= pushes[v][1] + 1e-3, (eid, c.index, v)
            for eid in keys:  # one execution's versions never go back
                vs = [c.policy_version for c in proxy.by_id[eid].tree.calls]
                assert vs == sorted(vs), (eid, vs)
        finally:
            lt.run(runner.cleanup())
            lt.run(router.close())
            lt.close()
