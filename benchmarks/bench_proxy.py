"""Proxy overhead: the same agent-shaped load sent to the engine directly and through the proxy.

Three measurements, each direct and proxied, side by side in one run:

1. **Short contexts, 64 and 256 executions** (``*_64``, ``*_256``): N concurrent executions each
   make CALLS sequential calls on a growing conversation (assistant reply + tool result per turn)
   against the embedded engine. Engine on one core; proxy and load generator share the other.
2. **Proxy on its own core, 256 executions** (``*_256_separate``): the same, with the proxy alone
   on one core (as on a head node) and the engine plus load generator on the other, for both the
   direct and the proxied run.
3. **32K-token contexts reusing stored ids** (``*_long``): LONG_N executions whose first message
   is a ~30K-token repository dump; the measured calls are the later ones, whose context the
   proxy rebuilds from stored ids. The CPU-only tiny model needs minutes for one 32K prefill
   (a GPU needs milliseconds), so these runs use ``EchoEngine`` below: a process with the
   engine's HTTP API that parses the 32K ids like SGLang and answers a fixed short output at
   once. Both the direct and the proxied run use it, so the difference is the proxy's work.

Added latency = proxied percentile - direct percentile. The proxy also reports its own time per
call (handler time minus the time on the wire to the engine), the cleaner figure on a 2-core
machine where the processes share CPUs. Pinning is done per thread (``taskset -a``), since the
engine and proxy run threads.

Writes benchmarks/results/proxy.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gyre.config import default_tiny_dir, load_config  # noqa: E402
from gyre.engine.launch import start_engine  # noqa: E402
from gyre.model.tiny import ensure_tiny_model  # noqa: E402
from gyre.model.tokenizer import load_tokenizer
from gyre.proxy.capture import Renderer  # noqa: E402

CALLS = 4
MAX_NEW = 8
LONG_N = 16  # concurrent long-context executions
LONG_CALLS = 5  # the first builds the 30K context; the other 4 are measured
LONG_TOKENS = 30_000
SYSTEM = "You are a coding agent. Use the bash tool to inspect and edit the repository."
TOOL_OUT = "total 8\n-rw-r--r-- 1 user user 120 main.py\n-rw-r--r-- 1 user user 64 test_main.py"
ADMIN = {"Authorization": "Bearer bench-admin"}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ---- the stand-in engine for 32K contexts --------------------------------------------------

def echo_engine_main(port_file: str) -> None:
    """Engine HTTP API without the model: parses /generate like SGLang, answers MAX_NEW ids."""
    from aiohttp import web

    r = Renderer(load_tokenizer(ensure_tiny_model(default_tiny_dir(load_config()))))
    out_ids = r.encode("Looking at the files now.")[: MAX_NEW - 1] + [r.im_end]

    async def generate(request):
        body = json.loads(await request.read())
        ids = body["input_ids"]
        assert all(isinstance(t, int) for t in ids)
        return web.json_response({"text": "", "output_ids": out_ids, "meta_info": {
            "id": body.get("rid"), "finish_reason": {"type": "stop", "matched": r.im_end}, "weight_version": "0",
            "prompt_tokens": len(ids), "completion_tokens": len(out_ids), "cached_tokens": len(ids) - 1,
            "output_token_logprobs": [[-0.1, t, None] for t in out_ids]}})

    async def server_info(request):
        return web.json_response({"context_length": 32768, "max_req_input_len": 32767})

    async def main():
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/generate", generate)
        app.router.add_get("/get_server_info", server_info)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        Path(port_file).write_text(str(site._server.sockets[0].getsockname()[1]))
        await asyncio.Event().wait()

    asyncio.run(main())


def start_echo_engine(tmp: Path) -> tuple[subprocess.Popen, str]:
    port_file = tmp / "echo.port"
    port_file.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, __file__, "--echo-engine", str(port_file)], cwd=ROOT)
    deadline = time.monotonic() + 60
    while not port_file.exists() or not port_file.read_text():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("echo engine did not start")
        time.sleep(0.05)
    return proc, f"http://127.0.0.1:{port_file.read_text()}"


# ---- load ----------------------------------------------------------------------------------

def repo_dump(r: Renderer, i: int) -> str:
    """~LONG_TOKENS tokens of file listings and code-like text (different per execution)."""
    rng = random.Random(i)
    words = ["def", "return", "self", "import", "class", "value", "index", "result", "path", "config", "=", "(", ")",
             ":", "if", "else", "for", "in", "None", "True", "0", "1", "data", "items", "key", "\n"]
    text = " ".join(rng.choice(words) for _ in range(LONG_TOKENS))
    ids = r.encode_text(text)
    return r.decode(ids[:LONG_TOKENS])


async def direct_execution(session, url, r: Renderer, i: int, lat: list[float], calls: int = CALLS,
                           first: str | None = None, skip: int = 0) -> None:
    user = first if first is not None else f"Task {i}: fix the failing test."
    ids = r.encode(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n") + r.encode_text(user) + [r.im_end]
    tool = r.newline + r.encode(f"<|im_start|>user\n<tool_response>\n{TOOL_OUT}\n</tool_response><|im_end|>")
    prompt = r.newline + r.assistant_head
    for k in range(calls):
        body = {"input_ids": ids + prompt, "return_logprob": True,
                "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 1.0, "stop_token_ids": r.stop_ids()}}
        t0 = time.perf_counter()
        async with session.post(url + "/generate", json=body) as resp:
            out = await resp.json()
        if k >= skip:
            lat.append(time.perf_counter() - t0)
        out_ids = out["output_ids"]
        ids = ids + prompt + out_ids + ([] if out_ids and out_ids[-1] == r.im_end else [r.im_end]) + tool


async def proxied_execution(session, url, key, i: int, lat: list[float], calls: int = CALLS,
                            first: str | None = None, skip: int = 0, gate: asyncio.Barrier | None = None) -> None:
    user = first if first is not None else f"Task {i}: fix the failing test."
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    headers = {"Authorization": f"Bearer {key}"}
    for k in range(calls):
        if gate is not None and k == skip:
            await gate.wait()  # every execution has built its long context: measure from here
        body = {"model": "main", "messages": msgs, "max_tokens": MAX_NEW, "temperature": 1.0}
        t0 = time.perf_counter()
        async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
            out = await resp.json()
        if k >= skip:
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
                             "--port", "0", "proxy.max_body_bytes=67108864"],
                            stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    for line in proc.stdout:
        if line.startswith("GYRE_PROXY_LISTENING"):
            return proc, line.split()[1]
    raise RuntimeError("proxy did not start")


async def register(session, url: str, n: int, tag: str) -> list[str]:
    keys = []
    for i in range(n):
        async with session.post(url + "/gyre/executions", json={"execution_id": f"{tag}-{i}"}, headers=ADMIN) as r:
            keys.append((await r.json())["api_key"])
    return keys


async def proxy_overhead(url: str) -> dict:
    """The proxy's own time per call since the last call of this (then a new window starts)."""
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/gyre/stats?reset=1", headers=ADMIN) as resp:
            return (await resp.json())["overhead"]


def pin(pid: int, cpus: set[int]) -> None:
    """Pin every thread of ``pid`` (taskset -a), where the machine has the CPUs."""
    if CPUS:
        subprocess.run(["taskset", "-a", "-p", "-c", ",".join(map(str, sorted(cpus))), str(pid)],
                       check=True, capture_output=True)


ALL = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
CPUS = len(ALL) >= 2


async def pair(results: dict, tag: str, n: int, engine_url: str, purl: str, r: Renderer) -> None:
    d_lat, d_wall = await run_load(n, lambda s, i, lat: direct_execution(s, engine_url, r, i, lat))
    async with aiohttp.ClientSession() as s:
        keys = await register(s, purl, n, f"c{tag}")
    await proxy_overhead(purl)
    p_lat, p_wall = await run_load(n, lambda s, i, lat: proxied_execution(s, purl, keys[i], i, lat))
    over = await proxy_overhead(purl)
    d_tp, p_tp = len(d_lat) / d_wall, len(p_lat) / p_wall
    results.update({
        f"direct_p50_ms_{tag}": 1e3 * statistics.median(d_lat), f"proxy_p50_ms_{tag}": 1e3 * statistics.median(p_lat),
        f"direct_p99_ms_{tag}": 1e3 * pct(d_lat, 0.99), f"proxy_p99_ms_{tag}": 1e3 * pct(p_lat, 0.99),
        f"direct_calls_per_s_{tag}": d_tp, f"proxy_calls_per_s_{tag}": p_tp,
        f"throughput_ratio_{tag}": p_tp / d_tp, f"in_proxy_p50_ms_{tag}": over.get("p50_ms"),
    })


LOAD_START = os.getloadavg()[0] if hasattr(os, "getloadavg") else -1.0


async def main() -> dict:
    model = ensure_tiny_model(default_tiny_dir(load_config()))
    r = Renderer(load_tokenizer(model))
    results: dict = {}
    lo, hi = (ALL[0], ALL[-1]) if CPUS else (0, 0)
    me = os.getpid()
    t_start = time.perf_counter()
    with start_engine(model_dir=model, extra_args=["--no-api-key"]) as eng:
        proxy, purl = start_proxy(eng.url, model)
        try:
            # layout 1: engine alone on `hi`; proxy and load generator share `lo`
            pin(eng.proc.pid, {hi})
            pin(proxy.pid, {lo})
            pin(me, {lo})
            await run_load(4, lambda s, i, lat: direct_execution(s, eng.url, r, i, lat))  # warm-up
            for n in (64, 256):
                await pair(results, str(n), n // SCALE, eng.url, purl, r)
            # layout 2: proxy alone on `lo`; engine and load generator share `hi`
            pin(me, {hi})
            await pair(results, "256_separate", 256 // SCALE, eng.url, purl, r)
        finally:
            proxy.terminate()
            proxy.wait(10)

    # 32K contexts against the echo engine; proxy alone on `lo`, engine + load generator on `hi`
    tmp = Path(tempfile.mkdtemp(prefix="gyre-bench-proxy-"))
    echo, echo_url = start_echo_engine(tmp)
    try:
        proxy, purl = start_proxy(echo_url, model)
        try:
            pin(echo.pid, {hi})
            pin(proxy.pid, {lo})
            pin(me, {hi})
            dumps = [repo_dump(r, i) for i in range(LONG_N)]
            d_lat, _ = await run_load(LONG_N, lambda s, i, lat: direct_execution(
                s, echo_url, r, i, lat, LONG_CALLS, dumps[i], skip=1))
            async with aiohttp.ClientSession() as s:
                keys = await register(s, purl, LONG_N, "long")
            # every execution makes its first (tokenizing) call, then the window is reset and
            # the calls that rebuild the 30K context from stored ids are measured
            gate = asyncio.Barrier(LONG_N + 1)

            async def reset_when_primed():
                await gate.wait()
                await proxy_overhead(purl)

            p_lat: list[float] = []
            conn = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=3600)) as s:
                await asyncio.gather(reset_when_primed(), *(
                    proxied_execution(s, purl, keys[i], i, p_lat, LONG_CALLS, dumps[i], skip=1, gate=gate)
                    for i in range(LONG_N)))
            over = await proxy_overhead(purl)
        finally:
            proxy.terminate()
            proxy.wait(10)
    finally:
        echo.terminate()
        echo.wait(10)
    long_lat = p_lat
    results.update({
        "direct_p50_ms_long": 1e3 * statistics.median(d_lat), "proxy_p50_ms_long": 1e3 * statistics.median(long_lat),
        "p50_added_ms_long": 1e3 * (statistics.median(long_lat) - statistics.median(d_lat)),
        "in_proxy_p50_ms_long": over["p50_ms"], "in_proxy_p99_ms_long": over["p99_ms"],
        "long_context_tokens": LONG_TOKENS, "long_executions": LONG_N,
    })
    results["p50_added_ms"] = results["proxy_p50_ms_64"] - results["direct_p50_ms_64"]
    results["p99_added_ms"] = results["proxy_p99_ms_64"] - results["direct_p99_ms_64"]
    results["in_proxy_p50_ms"] = results["in_proxy_p50_ms_64"]
    results["throughput_ratio_256_separate"] = results.pop("throughput_ratio_256_separate")
    results["cpu_pinned"] = CPUS
    results["calls_per_execution"] = CALLS
    results["max_new_tokens"] = MAX_NEW
    results["bench_wall_s"] = time.perf_counter() - t_start
    # the machine's load while this ran: on a shared 2-core box, figures taken at a load far
    # above 2 measure the other jobs more than the proxy
    results["load_average_1min_start"], results["load_average_1min_end"] = LOAD_START, os.getloadavg()[0]
    return results


SCALE = 1  # --smoke: 1/16 of the executions, to check the script itself (results not written)

if __name__ == "__main__":
    if "--smoke" in sys.argv:
        SCALE, LONG_N = 16, 2
    if len(sys.argv) == 3 and sys.argv[1] == "--echo-engine":
        echo_engine_main(sys.argv[2])
        sys.exit(0)
    res = asyncio.run(main())
    if SCALE != 1:
        print(json.dumps(res, indent=2))
        sys.exit(0)
    out = ROOT / "benchmarks" / "results" / "proxy.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
