"""Router over real engine subprocesses: affinity, elastic endpoints, retry of aborted requests."""

from __future__ import annotations

import asyncio
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

from gyre.engine.client import EngineClient, EngineError
from gyre.engine.launch import start_engine
from gyre.engine.router import Router, RouterError
from gyre.model.tiny import ensure_tiny_model

PROMPT = [1, 882, 198, 40, 1000, 2000, 17, 2, 198, 1, 77, 198]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    tiny = ensure_tiny_model(tmp_path_factory.getbasetemp() / "tiny-qwen")
    with ThreadPoolExecutor(3) as pool:  # start them in parallel
        procs = list(pool.map(lambda _: start_engine(tiny, extra_args=["--no-api-key"]), range(3)))
    yield [p.url for p in procs]
    for p in procs:
        p.stop()


def dead_url() -> str:
    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_affinity_spreads_keys_and_reuses_prefix_cache(engines):
    async def scenario():
        async with Router(engines) as router:
            served = {}
            for i in range(60):
                key = f"exec-{i}"
                first = await router.generate(key, PROMPT + [i], {"max_new_tokens": 4, "temperature": 0})
                second = await router.generate(key, PROMPT + [i] + first.output_ids + [198],
                                               {"max_new_tokens": 4, "temperature": 0})
                assert first.endpoint == second.endpoint == router.pick(key)
                # Same endpoint, so the second call of the execution reuses the first one's KV cache.
                assert second.cached_tokens == len(PROMPT) + 1 + 4 - 1
                served[key] = first.endpoint
            counts = {u: list(served.values()).count(u) for u in engines}
            # Ports are random, so the split varies; Binomial(60, 1/3) < 6 has p ~ 1e-5.
            assert all(n >= 6 for n in counts.values()), counts

    asyncio.run(scenario())


def test_add_and_remove_endpoints_at_runtime(engines):
    async def scenario():
        async with Router(engines[:2]) as router:
            keys = [f"k{i}" for i in range(60)]
            before = {k: router.pick(k) for k in keys}
            router.add_endpoint(engines[2])
            assert router.endpoints() == engines
            after = {k: router.pick(k) for k in keys}
            moved = [k for k in keys if before[k] != after[k]]
            # Rendezvous hashing: only keys that now belong to the new endpoint move.
            assert moved and all(after[k] == engines[2] for k in moved)
            res = await router.generate(moved[0], PROMPT, {"max_new_tokens": 2})
            assert res.endpoint == engines[2]
            assert await router.remove_endpoint(engines[2]) == 0
            assert router.endpoints() == engines[:2]
            assert {k: router.pick(k) for k in keys} == before
            res = await router.generate(moved[0], PROMPT, {"max_new_tokens": 2})
            assert res.endpoint in engines[:2]

    asyncio.run(scenario())


def test_removed_endpoints_aborted_stream_continues_elsewhere(engines):
    """A role switch mid-stream: the tokens already passed on stay, the rest comes from another
    endpoint (greedy, so the whole answer equals one uninterrupted generation)."""
    async def scenario():
        async with Router(engines) as router:
            key = "exec-long"
            home = router.pick(key)
            params = {"max_new_tokens": 300, "ignore_eos": True, "temperature": 0}
            stream = router.generate_stream(key, PROMPT, params, rid="long-r")
            first = await stream.__anext__()  # it runs on its home endpoint
            assert first.endpoint == home and first.finish_reason is None
            assert router.in_flight() == {home: 1}
            assert await router.remove_endpoint(home) == 1
            snaps = [s async for s in stream]
            last = snaps[-1]
            assert last.finish_reason == "length" and len(last.output_ids) == 300
            assert last.endpoint != home and last.endpoint in router.endpoints()
            assert all(len(a.output_ids) <= len(b.output_ids) for a, b in zip(snaps, snaps[1:]))
            assert router.in_flight() == {}
            router.add_endpoint(home)
            whole = await router.generate("exec-other", PROMPT, params)
            assert last.output_ids == whole.output_ids and len(last.logprobs) == 300

    asyncio.run(scenario())


def test_user_abort_is_not_retried(engines):
    async def scenario():
        async with Router(engines) as router:
            stream = router.generate_stream("exec-x", PROMPT, {"max_new_tokens": 4000, "ignore_eos": True},
                                            rid="user-abort")
            await stream.__anext__()
            assert await router.abort("user-abort") == 1
            res = [s async for s in stream][-1]
            assert res.finish_reason == "abort" and len(res.output_ids) < 4000

    asyncio.run(scenario())


def test_cancelled_caller_aborts_its_engine_request(engines):
    async def scenario():
        async with Router(engines[:1]) as router:
            stream = router.generate_stream("exec-c", PROMPT, {"max_new_tokens": 4000, "ignore_eos": True},
                                            rid="gone")
            await stream.__anext__()
            await stream.aclose()  # what a proxy does when its client disconnects
            assert router.in_flight() == {}
            # the engine stopped it: a flush (refused while anything runs) succeeds soon after
            async with EngineClient(engines[0]) as c:
                for _ in range(500):
                    try:
                        await c.flush_cache()
                        break
                    except EngineError:
                        await asyncio.sleep(0.01)
                else:
                    raise AssertionError("the engine kept generating for a caller that left")

    asyncio.run(scenario())


def test_connection_errors_and_released_endpoints_move_to_another(engines):
    async def scenario():
        dead = dead_url()
        async with Router([dead, engines[0]], connect_retries=0) as router:
            keys = [k for k in (f"d{i}" for i in range(50)) if router.pick(k) == dead]
            res = await router.generate(keys[0], PROMPT, {"max_new_tokens": 2})
            assert res.endpoint == engines[0]
        async with EngineClient(engines[1]) as c, Router([engines[1], engines[2]]) as router:
            key = next(k for k in (f"r{i}" for i in range(50)) if router.pick(k) == engines[1])
            await c.release_memory(["kv_cache", "weights"])
            try:  # a 503 (memory released for a role switch) moves the call elsewhere
                res = await router.generate(key, PROMPT, {"max_new_tokens": 2})
                assert res.endpoint == engines[2]
            finally:
                await c.resume_memory(["kv_cache", "weights"])

    asyncio.run(scenario())


def test_bad_request_is_not_retried(engines):
    async def scenario():
        async with Router(engines) as router:
            with pytest.raises(EngineError) as e:
                await router.generate("k", [99999], {})
            assert e.value.status == 400

    asyncio.run(scenario())


def test_no_endpoint_left_is_a_clear_error(engines):
    async def scenario():
        async with Router([dead_url(), dead_url()], connect_retries=0) as router:
            with pytest.raises(RouterError, match="no endpoint left.*unreachable"):
                await router.generate("k", PROMPT, {"max_new_tokens": 2})
        async with Router([]) as router:
            with pytest.raises(RouterError, match="no endpoint left"):
                await router.generate("k", PROMPT, {"max_new_tokens": 2})
        # With a grace period, a request waits for an endpoint to be added.
        async with Router([], wait_for_endpoint_s=10) as router:
            task = asyncio.create_task(router.generate("k", PROMPT, {"max_new_tokens": 2}))
            await asyncio.sleep(0.2)
            assert not task.done()
            router.add_endpoint(engines[0])
            assert (await task).endpoint == engines[0]

    asyncio.run(scenario())
