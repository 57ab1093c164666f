"""What replay-resume costs and saves, on one machine (`gyre rollout`, embedded engine).

A rollout of the builtin suite (reference harness, sub-agent and compaction on) is stopped as a
preemption stops it (SIGTERM path: harnesses ended, what was recorded written) once the calls
made reach ~30%, ~60% and ~90% of what a whole run makes. Each stopped run directory is copied
twice and resumed once with ``harness.resume = "replay"`` and once with ``"restart"``.

Figures (one flat JSON, benchmarks/results/resume.json):
- replayed_calls_share_<p>: calls answered from the recording / calls of the resumed executions;
- resume_time_over_restart_<p>: wall time of the replay resume / that of the restart resume;
- resume_s_<p>_replay / _restart; diverged_<p>: resumed executions whose harness asked something
  that was not recorded before the recording ran out (the reference harness is deterministic
  given its answers, so 0 is expected; a harness with a clock in its prompt diverges at its first
  call: tests/proxy/test_proxy_replay.py);
- full_run_s, full_run_calls: the uninterrupted run.
On this toy the engine's generation is a small part of an execution (evaluation and process
start-up dominate), so the time saved is small here; on the paper's profile it is ~2 h per
execution of GPU work.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gyre.config import load_config  # noqa: E402
from gyre.offline_rollout import Rollout  # noqa: E402

AGENT = ["{python}", "-m", "gyre.harness.reference_agent", "--max-tokens", "48", "--max-turns", "8",
         "--compact-chars", "900", "--subagent-turn", "2", "--subagent-max-turns", "1"]


def cfg_for(run_dir: Path, *extra: str):
    cmd = "[" + ", ".join(f'"{c}"' for c in AGENT) + "]"
    return load_config(None, [f"run.dir={run_dir}", "engine.endpoints=1", "harness.group_size=2",
                              "harness.concurrency=4", 'harness.tasks=["fizzbuzz", "roman"]',
                              f"harness.command={cmd}", "harness.timeout_s=300", "eval.timeout_s=120", *extra])


async def stopped_at(run_dir: Path, calls: int) -> int:
    ro = Rollout(cfg_for(run_dir), progress=False)
    task = asyncio.create_task(ro.run())
    await ro.started.wait()
    while ro.proxy.calls_total < calls and not task.done():
        await asyncio.sleep(0.02)
    made = ro.proxy.calls_total
    ro.stop()
    await task
    return made


def resume(run_dir: Path, mode: str) -> tuple[float, object]:
    t = time.monotonic()
    s = asyncio.run(Rollout(cfg_for(run_dir, f"harness.resume={mode}"), progress=False).run(resume=True))
    return time.monotonic() - t, s


def main() -> dict:
    res: dict = {}
    with tempfile.TemporaryDirectory(prefix="gyre-bench-resume-") as tmp:
        tmp = Path(tmp)
        t = time.monotonic()
        full = asyncio.run(Rollout(cfg_for(tmp / "full"), progress=False).run())
        res["full_run_s"], res["full_run_calls"] = round(time.monotonic() - t, 2), full.calls
        for share in (0.3, 0.6, 0.9):
            p = f"{int(share * 100)}"
            base = tmp / f"stop{p}"
            made = asyncio.run(stopped_at(base, int(share * full.calls)))
            res[f"calls_at_stop_{p}"] = made
            shutil.copytree(base, tmp / f"stop{p}-restart")
            secs = {}
            for mode, d in (("replay", base), ("restart", tmp / f"stop{p}-restart")):
                secs[mode], s = resume(d, mode)
                res[f"resume_s_{p}_{mode}"] = round(secs[mode], 2)
                res[f"resumed_calls_{p}_{mode}"] = s.calls
                if mode == "replay":
                    res[f"replayed_calls_{p}"] = s.replayed_calls
                    res[f"replayed_calls_share_{p}"] = round(s.replayed_calls / s.calls, 3) if s.calls else 0.0
                    res[f"resumed_executions_{p}"] = s.resumed
                    res[f"diverged_{p}"] = s.diverged
            res[f"resume_time_over_restart_{p}"] = round(secs["replay"] / secs["restart"], 3)
    out = ROOT / "benchmarks" / "results" / "resume.json"
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
