"""Harness throughput: what one machine sustains with the reference harness, against the engine.

1. `gyre rollout` of the builtin suite with the reference harness (sub-agent and compaction on,
   short answers) on one embedded engine: executions/hour and calls/s, evaluation included.
2. The same engine then replays exactly the calls that run recorded (their input ids, the same
   number of output tokens, same concurrency) with nothing else around it: the engine's own time.

overhead_ratio = rollout wall time / engine-only replay time: how much harness processes, the
proxy and the evaluator cost on top of generation on this machine.

3. Task environments and isolation (the rollout above runs under the default sandbox):
   - sandbox: the host sandbox backend harnesses ran in (bwrap where installed);
   - the added cost of the sandbox per execution: the same small harness (one call through the
     proxy path) and the same evaluation (a builtin task's reference solution), bare
     (harness.sandbox = none) and sandboxed, interleaved; seconds added and the ratio;
   - image_task_scored: an NL2RepoBench-shaped task run and scored inside a task image built
     offline (tests/support/task_image.py), its harness and its evaluation each in a fresh instance;
   - scoring_parity_cases / _mismatches: Gyre's scorer against the official analyze_pytest_results
     (read from the benchmark's repository where at hand, else the corpus's hand-worked counts).

Writes benchmarks/results/rollout.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the test image builder, the scoring corpus

from gyre.config import default_tiny_dir, load_config  # noqa: E402
from gyre.engine.launch import start_engine  # noqa: E402
from gyre.model.tiny import ensure_tiny_model  # noqa: E402
from gyre.offline_rollout import Rollout  # noqa: E402
from gyre.traj.store import iter_executions  # noqa: E402

AGENT = ["{python}", "-m", "gyre.harness.reference_agent", "--max-tokens", "48", "--max-turns", "6",
         "--compact-chars", "1500"]
CONCURRENCY = 8


async def replay(url: str, executions: list[list[tuple[list[int], int]]], concurrency: int) -> float:
    """Each execution's calls in order (so the prefix cache helps as it did live), `concurrency`
    executions at a time, exactly the recorded input ids and output lengths."""
    sem = asyncio.Semaphore(concurrency)

    async def one(s, calls):
        async with sem:
            for ids, n in calls:
                body = {"input_ids": ids, "return_logprob": True,
                        "sampling_params": {"max_new_tokens": max(1, n), "temperature": 1.0, "ignore_eos": True}}
                async with s.post(url + "/generate", json=body) as r:
                    await r.read()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(s, calls) for calls in executions))
        return time.perf_counter() - t0


def _timed_harness(tmp: Path, mode: str, i: int, port: int) -> float:
    import warnings

    from gyre.harness.runner import HarnessPool
    from gyre.harness.sandbox import Environments, SandboxConfig
    from gyre.harness.tasks import load_suite

    task = load_suite("builtin")[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        envs = Environments(SandboxConfig(sandbox=mode))
    code = "import os, urllib.request; urllib.request.urlopen(os.environ['OPENAI_BASE_URL'] + '/ping').read()"
    pool = HarnessPool(tmp / f"cost-{mode}", ["{python}", "-c", code], environments=envs)
    t0 = time.perf_counter()
    res = asyncio.run(pool.run_execution(task, f"c{i}", api_key="k", base_url=f"http://127.0.0.1:{port}/v1"))
    assert res.status == "done", res
    return time.perf_counter() - t0


def _timed_eval(tmp: Path, mode: str, i: int) -> float:
    import shutil
    import warnings

    from gyre.harness.evaluator import EvalOptions, evaluate_workspace
    from gyre.harness.sandbox import Environments, SandboxConfig
    from gyre.harness.tasks import BUILTIN_DIR, load_suite

    task = {t.name: t for t in load_suite("builtin")}["fizzbuzz"]
    ws = tmp / f"ws-{mode}-{i}"
    shutil.copytree(Path(BUILTIN_DIR).parent / "builtin_solutions" / "fizzbuzz", ws)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        envs = Environments(SandboxConfig(sandbox=mode))
    t0 = time.perf_counter()
    ev = evaluate_workspace(task, ws, "done", EvalOptions(timeout_s=120, environments=envs))
    assert ev.reward == 1.0, ev
    return time.perf_counter() - t0


def sandbox_cost(reps: int = 5) -> dict:
    """Bare and sandboxed, interleaved so that a busy machine weighs on both alike."""
    import statistics
    import threading

    from aiohttp import web

    async def ping(request):
        return web.Response(text="pong")

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_get("/v1/ping", ping)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()
    times = {("h", m): [] for m in ("none", "auto")} | {("e", m): [] for m in ("none", "auto")}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(reps):
                for m in ("none", "auto") if i % 2 == 0 else ("auto", "none"):
                    times[("h", m)].append(_timed_harness(Path(tmp), m, i, port))
                    times[("e", m)].append(_timed_eval(Path(tmp), m, i))
    finally:
        loop.call_soon_threadsafe(loop.stop)
        th.join(5)
    med = {k: statistics.median(v) for k, v in times.items()}
    bare, boxed = med[("h", "none")] + med[("e", "none")], med[("h", "auto")] + med[("e", "auto")]
    h, e = ("h", "none"), ("e", "none")
    return {"sandbox_harness_added_s": med[("h", "auto")] - med[h],
            "sandbox_harness_ratio": med[("h", "auto")] / med[h],
            "sandbox_eval_added_s": med[("e", "auto")] - med[e], "sandbox_eval_ratio": med[("e", "auto")] / med[e],
            "load_avg_1m": os.getloadavg()[0],  # the machine is shared: context for the seconds above
            "sandbox_harness_bare_s": med[("h", "none")], "sandbox_harness_boxed_s": med[("h", "auto")],
            "sandbox_eval_bare_s": med[("e", "none")], "sandbox_eval_boxed_s": med[("e", "auto")],
            "sandbox_added_s_per_execution": boxed - bare, "sandbox_cost_ratio": boxed / bare,
            "sandbox_cost_reps": reps}


def image_task() -> dict:
    """An NL2RepoBench-shaped task, harness and evaluation inside its (offline-built) image."""
    from support import task_image

    from gyre.harness.evaluator import EvalOptions, evaluate_workspace
    from gyre.harness.runner import HarnessPool
    from gyre.harness.sandbox import Environments, SandboxConfig
    from gyre.harness.tasks import read_suite

    if task_image.available() is not None:
        return {"image_task_scored": False, "image_task_note": task_image.available()}
    code = ("open('/workspace/mini.py', 'w').write('def add(a, b):\\n    return a + b\\n"
            "def sub(a, b):\\n    return a - b\\ndef mul(a, b):\\n    return a * b\\n"
            "def div(a, b):\\n    return a / b\\n')")
    with tempfile.TemporaryDirectory() as tmp:
        envs = Environments(SandboxConfig(image_dir=str(task_image.build_image_dir())))
        task = read_suite(task_image.nl2repo_suite(Path(tmp) / "suite")).tasks[0]
        t0 = time.perf_counter()
        res = asyncio.run(HarnessPool(Path(tmp) / "run", ["{python}", "-c", code], environments=envs)
                          .run_execution(task, "mini-g0", api_key="k", base_url="http://127.0.0.1:1/v1"))
        ev = evaluate_workspace(task, res.workspace, res.status, EvalOptions(timeout_s=120, environments=envs))
        dt = time.perf_counter() - t0
    return {"image_task_scored": ev.reward is not None and ev.environment.startswith(envs.place(task).runtime.name),
            "image_task_runtime": envs.place(task).runtime.name, "image_task_reward": ev.reward,
            "image_task_official": ev.official_reward, "image_task_s": dt}


def scoring_parity() -> dict:
    """Gyre's scorer against NL2RepoBench's own analyze_pytest_results (where its repository is at
    hand, else the hand-worked counts): the corpus of outputs, plus commands with exit status,
    stdout and stderr apart, read as the official runner reads them (tests/support/scoring_corpus.py)."""
    from support.official_scorer import load_official
    from support.scoring_corpus import CASES, STREAM_CASES, official_score

    from gyre.harness import scoring

    official = load_official()
    everything = [(r, c, p) for _, r, c, p in CASES] + [
        ([(cmd, scoring.command_output(scoring.split_command(cmd), rc, out, err)) for cmd, rc, out, err in r], c, p)
        for _, r, c, p, _ in STREAM_CASES]
    mismatches = 0
    for results, count, passed in everything:
        got = scoring.count_outputs(results, count)
        if official is not None:
            ref = official([{"command": c, "output": o} for c, o in results], count)
            want = (ref["passed"], ref["success_rate"])
            mismatches += (got.passed, got.score) != want or ref["passed"] != passed
        else:
            mismatches += (got.passed, got.score) != (passed, official_score(passed, count))
    return {"scoring_parity_cases": len(everything), "scoring_parity_mismatches": mismatches,
            "scoring_parity_reference": "official analyze_pytest_results" if official else "hand-worked corpus"}


def main() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = "[" + ", ".join(f'"{c}"' for c in AGENT) + "]"
        cfg = load_config(None, [f"run.dir={tmp}/run", "engine.endpoints=1", "harness.group_size=2",
                                 f"harness.concurrency={CONCURRENCY}", f"harness.command={cmd}",
                                 "eval.workers=2"])
        t0 = time.perf_counter()
        summary = asyncio.run(Rollout(cfg, progress=False).run())
        wall = time.perf_counter() - t0
        recs = list(iter_executions(Path(tmp) / "run" / "shards"))
        per_exec = [[(rec.tree.call_input_ids(c).tolist(), c.n_output)
                     for c in sorted(rec.tree.calls, key=lambda c: c.t_start)] for rec in recs]
        calls = [c for ex in per_exec for c in ex]
        model = ensure_tiny_model(default_tiny_dir(cfg))
        with start_engine(model_dir=model, extra_args=["--no-api-key"]) as eng:  # loopback replay only
            engine_s = asyncio.run(replay(eng.url, per_exec, CONCURRENCY))
    n_exec, n_calls = len(recs), len(calls)
    return {"executions": n_exec, "calls": n_calls, "wall_s": wall, "engine_replay_s": engine_s,
            "executions_per_hour": n_exec / wall * 3600, "calls_per_s": n_calls / wall,
            "engine_calls_per_s": n_calls / engine_s, "overhead_ratio": wall / engine_s,
            "concurrency": CONCURRENCY, "by_status": summary.executions,
            "output_tokens": sum(n for _, n in calls), "harness": " ".join(AGENT[2:]),
            "sandbox": summary.sandbox, "official_score_mean": sum(summary.official) / max(1, len(summary.official)),
            **environments()}


def environments() -> dict:
    """Sections 3 (task environments and isolation): quick, and runnable alone (--environments)."""
    from gyre.harness.sandbox import Environments, SandboxConfig

    return {"sandbox": Environments(SandboxConfig()).host_backend, **sandbox_cost(), **image_task(), **scoring_parity()}


if __name__ == "__main__":
    out = ROOT / "benchmarks" / "results" / "rollout.json"
    if "--environments" in sys.argv:  # only section 3, merged into the last full run's figures
        res = {**(json.loads(out.read_text()) if out.exists() else {}), **environments()}
    elif "--parity" in sys.argv:  # only the scoring parity figures, merged likewise
        res = {**(json.loads(out.read_text()) if out.exists() else {}), **scoring_parity()}
    else:
        res = main()
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
