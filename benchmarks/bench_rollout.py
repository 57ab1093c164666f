"""Harness throughput: what one machine sustains with the reference harness, against the engine.

1. `gyre rollout` of the builtin suite with the reference harness (sub-agent and compaction on,
   short answers) on one embedded engine: executions/hour and calls/s, evaluation included.
2. The same engine then replays exactly the calls that run recorded (their input ids, the same
   number of output tokens, same concurrency) with nothing else around it: the engine's own time.

overhead_ratio = rollout wall time / engine-only replay time: how much harness processes, the
proxy and the evaluator cost on top of generation on this machine.

Writes benchmarks/results/rollout.json.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gyre.config import default_tiny_dir, load_config  # noqa: E402
from gyre.engine.launch import start_engine  # noqa: E402
from gyre.engine.tiny_model import ensure_tiny_model  # noqa: E402
from gyre.rollout import Rollout  # noqa: E402
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
        with start_engine(model_dir=model) as eng:
            engine_s = asyncio.run(replay(eng.url, per_exec, CONCURRENCY))
    n_exec, n_calls = len(recs), len(calls)
    return {"executions": n_exec, "calls": n_calls, "wall_s": wall, "engine_replay_s": engine_s,
            "executions_per_hour": n_exec / wall * 3600, "calls_per_s": n_calls / wall,
            "engine_calls_per_s": n_calls / engine_s, "overhead_ratio": wall / engine_s,
            "concurrency": CONCURRENCY, "by_status": summary.executions,
            "output_tokens": sum(n for _, n in calls), "harness": " ".join(AGENT[2:])}


if __name__ == "__main__":
    res = main()
    out = ROOT / "benchmarks" / "results" / "rollout.json"
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
