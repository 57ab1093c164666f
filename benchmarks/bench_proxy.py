"""Proxy overhead: the same agent-shaped load sent to the engine directly and through the proxy.

N concurrent executions (64, then 256) each make CALLS sequential calls on a growing
conversation (assistant reply + tool result per turn). The direct client sends the equivalent
input ids straight to the engine's /generate; the proxied client sends OpenAI chat requests to
`gyre proxy` (its own process, as on the head). Both runs hit the same embedded engine in the same
run. Added latency = proxied percentile − direct percentile; the proxy also reports its own
in-process time per call (handler time minus the engine round trip), which is the cleaner figure
on a 2-core machine where all three processes share the CPUs.

Writes benchmarks/results/proxy.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gyre.config import default_tiny_dir, load_config  # noqa: E402
from gyre.engine.launch import start_engine  # noqa: E402
from gyre.engine.tiny_model import ensure_tiny_model, load_tokenizer  # noqa: E402
from gyre.proxy.capture import Renderer  # noqa: E402

CALLS = 4
MAX_NEW = 8
SYSTEM = "You are a coding agent. Use the bash tool to inspect and edit the repository."
TOOL_OUT = "total 8\n-rw-r--r-- 1 user user 120 main.py\n-rw-r--r-- 1 user user 64 test_main.py"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def direct_execution(session, url, r: Renderer, i: int, lat: list[float]) -> None:
    ids = r.encode(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nTask {i}: fix the failing test.<|im_end|>")
    tool = r.newline + r.encode(f"<|im_start|>user\n<tool_response>\n{TOOL_OUT}\n</tool_response><|im_end|>")
    prompt = r.newline + r.assistant_head
    for _ in range(CALLS):
        body = {"input_ids": ids + prompt, "return_logprob": True,
                "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 1.0, "stop_token_ids": r.stop_ids()}}
        t0 = time.perf_counter()
        async with session.post(url + "/generate", json=body) as resp:
            out = await resp.json()
        lat.append(time.perf_counter() - t0)
        out_ids = out["output_ids"]
        ids = ids + prompt + out_ids + ([] if out_ids and out_ids[-1] == r.im_end else [r.im_end]) + tool


async def proxied_execution(session, url, key, i: int, lat: list[float]) -> None:
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Task {i}: fix the failing test."}]
    headers = {"Authorization": f"Bearer {key}"}
    for k in range(CALLS):
        body = {"model": "main", "messages": msgs, "max_tokens": MAX_NEW, "temperature": 1.0}
        t0 = time.perf_counter()
        async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
            out = await resp.json()
        lat.append(time.perf_counter() - t0)
        msgs = msgs + [out["choices"][0]["message"], {"role": "tool", "tool_call_id": f"c{k}", "content": TOOL_OUT}]


async def run_load(n: int, make) -> tuple[list[float], float]:
    lat: list[float] = []
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=3600)) as s:
        t0 = time.perf_counter()
        await asyncio.gather(*(make(s, i, lat) for i in range(n)))
        wall = time.perf_counter() - t0
    return lat, wall


def start_proxy(engine_url: str, model: Path) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, GYRE_ADMIN_KEY="bench-admin")
    proc = subprocess.Popen([sys.executable, "-m", "gyre.cli", "proxy", "--engine", engine_url, "--model", str(model),
                             "--port", "0"], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    for line in proc.stdout:
        if line.startswith("GYRE_PROXY_LISTENING"):
            return proc, line.split()[1]
    raise RuntimeError("proxy did not start")


async def register(session, url: str, n: int, tag: str) -> list[str]:
    keys = []
    for i in range(n):
        async with session.post(url + "/gyre/executions", json={"execution_id": f"{tag}-{i}"},
                                headers={"Authorization": "Bearer bench-admin"}) as r:
            keys.append((await r.json())["api_key"])
    return keys


def pin(cpus: set[int]) -> None:
    """Pin this process (and the children it starts next) to `cpus`, where the machine has them."""
    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2:
        os.sched_setaffinity(0, cpus)


async def main() -> dict:
    model = ensure_tiny_model(default_tiny_dir(load_config()))
    r = Renderer(load_tokenizer(model))
    results: dict = {}
    # On a cluster the proxy runs on the head node and the engines on GPU nodes. On this 2-core
    # machine we mimic that: the engine gets CPU 1, the proxy and the load generator CPU 0, for
    # both the direct and the proxied run, so the engine's speed is the same in both.
    all_cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    pinned = len(all_cpus) >= 2
    if pinned:
        pin({max(all_cpus)})
    with start_engine(model_dir=model, extra_args=["--no-api-key"]) as eng:
        if pinned:
            pin({min(all_cpus)})
        proxy, purl = start_proxy(eng.url, model)
        try:
            # warm-up both paths
            await run_load(4, lambda s, i, lat: direct_execution(s, eng.url, r, i, lat))
            for n in (64, 256):
                d_lat, d_wall = await run_load(n, lambda s, i, lat: direct_execution(s, eng.url, r, i, lat))
                async with aiohttp.ClientSession() as s:
                    keys = await register(s, purl, n, f"c{n}")
                p_lat, p_wall = await run_load(n, lambda s, i, lat: proxied_execution(s, purl, keys[i], i, lat))
                d_tp, p_tp = len(d_lat) / d_wall, len(p_lat) / p_wall
                results.update({
                    f"direct_p50_ms_{n}": 1e3 * statistics.median(d_lat), f"proxy_p50_ms_{n}": 1e3 * statistics.median(p_lat),
                    f"direct_p99_ms_{n}": 1e3 * pct(d_lat, 0.99), f"proxy_p99_ms_{n}": 1e3 * pct(p_lat, 0.99),
                    f"direct_calls_per_s_{n}": d_tp, f"proxy_calls_per_s_{n}": p_tp,
                    f"throughput_ratio_{n}": p_tp / d_tp,
                })
            async with aiohttp.ClientSession() as s:
                async with s.get(purl + "/gyre/stats", headers={"Authorization": "Bearer bench-admin"}) as resp:
                    over = (await resp.json())["overhead"]
        finally:
            proxy.terminate()
            proxy.wait(10)
    results["p50_added_ms"] = results["proxy_p50_ms_64"] - results["direct_p50_ms_64"]
    results["p99_added_ms"] = results["proxy_p99_ms_64"] - results["direct_p99_ms_64"]
    results["in_proxy_p50_ms"] = over["p50_ms"]
    results["in_proxy_p99_ms"] = over["p99_ms"]
    results["cpu_pinned"] = pinned
    results["calls_per_execution"] = CALLS
    results["max_new_tokens"] = MAX_NEW
    return results


if __name__ == "__main__":
    res = asyncio.run(main())
    out = ROOT / "benchmarks" / "results" / "proxy.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
