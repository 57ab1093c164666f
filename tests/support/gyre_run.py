"""`gyre run` as the online tests drive it, and what they read back (report, ledger)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
# W&B off: no test of a gyre_run job reads it, and its start is ~0.9 s of the head's CPU per job
# (tests/report/test_report.py checks the offline W&B run; the Slurm jobs keep the default loggers)
SMALL = ["sched.cells=2", "harness.group_size=4", "harness.concurrency=8", "sched.min_dwell_s=0.5", "eval.workers=2",
         'run.loggers=["jsonl", "tensorboard"]']


def gyre_run(run_dir: Path, *over: str, steps: int = 2, resume: bool = False, wait: bool = True, timeout: float = 400,
             env: dict | None = None):
    cmd = [sys.executable, "-m", "gyre.cli", "run", "--config", str(ROOT / "launchers" / "demo.toml"), "--no-plots"]
    if resume:
        cmd.append("--resume")
    cmd += [f"run.dir={run_dir}", f"run.steps={steps}", *SMALL, *over]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            start_new_session=True, env=None if env is None else {**os.environ, **env})
    if not wait:
        return proc
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, out


def report(run_dir: Path) -> dict:
    return json.loads((run_dir / "report.json").read_text())


def ledger(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines() if '"execution"' in line]


def check_ledger(run_dir: Path) -> list[dict]:
    """Every ended execution is trained once or recorded as not admitted, with its reason."""
    from gyre.traj.store import iter_executions

    rows = ledger(run_dir)
    trained = Counter(r["execution"] for r in rows if r["admitted"])
    assert all(n == 1 for n in trained.values()), trained.most_common(3)
    for r in rows:
        assert r["admitted"] or r["reason"], r
    ended = {rec.execution_id for rec in iter_executions(run_dir / "shards")}
    assert ended <= {r["execution"] for r in rows}
    return rows


def wait_for(pred, timeout: float, what: str):
    """pred()'s first truthy value, looked for every 0.05 s (a run's state, not a moment in time)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
