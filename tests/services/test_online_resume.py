"""`gyre run --resume` keeps the run's history (issue 45): the report, the plots and the metrics
cover every session of the run, not the last one. Whole runs (head + cells under mpiexec)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.gyre_run import ROOT, SMALL, check_ledger

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def run(run_dir: Path, steps: int, resume: bool) -> str:
    """`gyre run` as a user types it, plots included."""
    cmd = [sys.executable, "-m", "gyre.cli", "run", "--config", str(ROOT / "launchers" / "demo.toml"),
           *(["--resume"] if resume else []), f"run.dir={run_dir}", f"run.steps={steps}", *SMALL,
           "harness.group_size=2", "run.loggers=[\"jsonl\"]"]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return proc.stdout


def files(run_dir: Path) -> dict[str, bytes]:
    return {name: (run_dir / name).read_bytes() for name in ("report.json", "gantt.png", "reward.png")}


@pytest.mark.timeout(1500)  # three gyre runs on a loaded 2-core machine
def test_resumed_runs_report_the_whole_run_and_a_finished_one_is_left_unchanged(tmp_path):
    run_dir = tmp_path / "r"
    run(run_dir, 1, resume=False)
    first = json.loads((run_dir / "report.json").read_text())
    assert [r["step"] for r in first["steps"]] == [0] and first["sessions"] == 1
    run(run_dir, 2, resume=True)  # a second session goes on to step 1
    rep = json.loads((run_dir / "report.json").read_text())
    assert [r["step"] for r in rep["steps"]] == [0, 1] and rep["sessions"] == 2, rep["steps"]
    assert rep["steps"][0] == first["steps"][0]  # the first session's step, as it was
    assert rep["steps"][1]["t_end"] > first["wall_s"]  # drawn after the first session
    assert rep["wall_s"] > first["wall_s"] and rep["version"] == 2
    for k, n in first["executions"].items():  # counts add up over the sessions
        assert rep["executions"][k] >= n
    assert sum(rep["executions"].values()) > sum(first["executions"].values())
    for c in rep["cells"]:  # each cell's time covers both sessions
        assert c["wall_s"] == pytest.approx(rep["wall_s"])
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "train/loss" in m] == [0, 1]
    check_ledger(run_dir)
    before = files(run_dir)
    out = run(run_dir, 2, resume=True)  # a finished run resumed: nothing to do, nothing lost
    assert "0 steps to go" in out, out[-2000:]
    after = files(run_dir)
    assert json.loads(after["report.json"]) == json.loads(before["report.json"])
    assert after["gantt.png"] == before["gantt.png"] and after["reward.png"] == before["reward.png"]
