"""Measure sglang-router against direct calls to the embedded engine (the router.py decision).

    python -m venv /tmp/sgr-venv && /tmp/sgr-venv/bin/pip install sglang-router==0.3.2
    python benchmarks/studies/eval_sglang_router.py --router-python /tmp/sgr-venv/bin/python

Starts two embedded engines and one sglang-router (``--policy manual``, affinity through the
``x-smg-routing-key`` header), then: (1) added latency of one hop, p50/p99 over N sequential
1-token ``/generate`` calls, alternating direct and routed; (2) a long request through the
router whose worker is removed (``DELETE /workers/{id}``) and aborted mid-way: is it retried on
the other worker, and does the answer say which worker served it? Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from a checkout

from gyre.engine.launch import start_engine  # noqa: E402
from gyre.engine.router import Router  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _measure(router: str, engines: list[str], n: int) -> dict:
    body = {"input_ids": [1, 20, 30, 40], "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True}
    direct, routed = [], []
    async with aiohttp.ClientSession() as s:
        async def call(url: str, headers: dict) -> float:
            t = time.perf_counter()
            async with s.post(url + "/generate", json=body, headers=headers) as r:
                await r.read()
                assert r.status == 200, r.status
            return (time.perf_counter() - t) * 1000

        # The routing key pins all routed calls to one worker; call that same worker directly.
        async with s.post(router + "/generate", json=body, headers={"x-smg-routing-key": "k"}) as r:
            await r.read()
        served = await _which(s, engines)
        target = engines[served] if served is not None else engines[0]
        for _ in range(20):  # warm both paths
            await call(target, {})
            await call(router, {"x-smg-routing-key": "k"})
        for _ in range(n):
            direct.append(await call(target, {}))
            routed.append(await call(router, {"x-smg-routing-key": "k"}))
    # Gyre's in-process router over the same worker, for comparison (same aiohttp stack).
    ours = []
    async with Router([target]) as r:
        for _ in range(20):
            await r.generate("k", body["input_ids"], body["sampling_params"])
        for _ in range(n):
            t = time.perf_counter()
            await r.generate("k", body["input_ids"], body["sampling_params"])
            ours.append((time.perf_counter() - t) * 1000)
    return {
        "gyre_router_p50_ms": statistics.median(ours), "gyre_router_p99_ms": _pct(ours, 0.99),
        "n": n, "direct_p50_ms": statistics.median(direct), "direct_p99_ms": _pct(direct, 0.99),
        "routed_p50_ms": statistics.median(routed), "routed_p99_ms": _pct(routed, 0.99),
        "added_p50_ms": statistics.median(routed) - statistics.median(direct),
        "added_p99_ms": _pct(routed, 0.99) - _pct(direct, 0.99),
    }


async def _which(s: aiohttp.ClientSession, engines: list[str]) -> int | None:
    """Index of the engine whose prefix cache holds the probe (it served the last call)."""
    for i, url in enumerate(engines):
        async with s.get(url + "/health") as r:
            if (await r.json()).get("prefix_cache_tokens", 0) > 0:
                return i
    return None


async def _abort_retry(router: str, engines: list[str]) -> dict:
    body = {"input_ids": [1, 2, 3], "rid": "long-1", "return_logprob": True,
            "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True, "temperature": 1.0}}
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(s.post(router + "/generate", json=body, headers={"x-smg-routing-key": "exec-7"}))
        running = None
        for _ in range(200):
            await asyncio.sleep(0.02)
            for i, url in enumerate(engines):
                async with s.get(url + "/health") as r:
                    if (await r.json())["running"]:
                        running = i
            if running is not None:
                break
        async with s.get(router + "/workers") as r:
            workers = (await r.json())["workers"]
        wid = next(w["id"] for w in workers if w["url"].rstrip("/") == engines[running])
        async with s.delete(f"{router}/workers/{wid}") as r:
            delete_status = r.status
        async with s.post(engines[running] + "/abort_request", json={"rid": "long-1"}) as r:
            await r.read()
        resp = await task
        data = await resp.json()
        headers = {k: v for k, v in resp.headers.items() if k.lower().startswith(("x-", "server"))}
    meta = data.get("meta_info", {})
    return {
        "delete_status": delete_status, "served_by": engines[running],
        "finish_reason": meta.get("finish_reason", {}).get("type"),
        "completion_tokens": meta.get("completion_tokens"),
        "retried_elsewhere": meta.get("finish_reason", {}).get("type") != "abort",
        "response_headers": headers, "response_names_worker": any(e in json.dumps(headers) for e in engines),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--router-python", default="/tmp/sgr-venv/bin/python")
    p.add_argument("--model", default=None)
    p.add_argument("-n", type=int, default=400)
    args = p.parse_args()
    engines = [start_engine(args.model, extra_args=["--no-api-key"]) for _ in range(2)]  # sglang-router sends no key
    port = _free_port()
    router = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([args.router_python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                             "--port", str(port), "--policy", "manual", "--log-level", "warn",
                             "--worker-urls", *[e.url for e in engines]],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        urls = [e.url for e in engines]

        async def run() -> dict:
            async with aiohttp.ClientSession() as s:
                for _ in range(200):
                    try:
                        async with s.get(router + "/workers") as r:
                            if sum(w["is_healthy"] for w in (await r.json())["workers"]) == len(urls):
                                break
                    except aiohttp.ClientError:
                        pass
                    await asyncio.sleep(0.1)
            return {"latency": await _measure(router, urls, args.n), "abort": await _abort_retry(router, urls)}

        print(json.dumps(asyncio.run(run()), indent=1))
    finally:
        proc.terminate()
        proc.wait()
        for e in engines:
            e.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
