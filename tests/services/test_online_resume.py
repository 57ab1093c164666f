"""`gyre run --resume` keeps the run's history (issue 45): the report, the plots and the metrics
cover every session of the run, not the last one; and validation rounds in `gyre run` (at the start,
after every step, at the end; scored by a reward function) are neither lost nor redone across a
resume. Whole runs (head + cells under mpiexec).

One run in three sessions carries every check of this file (a job start is most of a test's CPU):
steps 0-1 with validation rounds v0-v2, a resumed session to step 2 (round v3 only), then the
finished run resumed again (nothing to do, nothing changed). The tests share it through a
module-scoped fixture, so this file is one pytest-xdist group (tests/conftest.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.gyre_run import ROOT, SMALL, check_ledger, report

from gyre.services.validation import ValidationLog
from gyre.traj.store import iter_executions

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1500)]  # the first test waits on three gyre runs

VALIDATE = ["validate.every_steps=1", "validate.suite=learnable", "validate.samples=2", "validate.k=2",
            "validate.pass_threshold=0.3", "reward.function=reward_fn:score",
            f'reward.pythonpath=["{ROOT / "docs" / "recipes"}"]']


def run(run_dir: Path, steps: int, resume: bool) -> str:
    """`gyre run` as a user types it, plots included."""
    cmd = [sys.executable, "-m", "gyre.cli", "run", "--config", str(ROOT / "launchers" / "demo.toml"),
           *(["--resume"] if resume else []), f"run.dir={run_dir}", f"run.steps={steps}", *SMALL,
           "sched.cells=1", "harness.group_size=2", "run.loggers=[\"jsonl\"]", *VALIDATE]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return proc.stdout


def files(run_dir: Path) -> dict[str, bytes]:
    return {name: (run_dir / name).read_bytes() for name in ("report.json", "gantt.png", "reward.png")}


def val_workspaces(run_dir: Path) -> set[str]:
    return {p.name for p in (run_dir / "workspaces").iterdir() if p.name.startswith("val")}


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("resume") / "r"
    s = {"dir": run_dir}
    s["out1"] = run(run_dir, 2, resume=False)
    s["first"] = json.loads((run_dir / "report.json").read_text())
    s["val_rounds1"] = set(ValidationLog(run_dir).rounds)
    s["val_ws1"] = val_workspaces(run_dir)
    s["out2"] = run(run_dir, 3, resume=True)  # a second session goes on to step 2
    s["val_ws2"] = val_workspaces(run_dir)
    s["files2"] = files(run_dir)
    s["out3"] = run(run_dir, 3, resume=True)  # a finished run resumed: nothing to do, nothing lost
    s["files3"] = files(run_dir)
    return s


def test_resumed_runs_report_the_whole_run(sessions):
    run_dir, first = sessions["dir"], sessions["first"]
    assert [r["step"] for r in first["steps"]] == [0, 1] and first["sessions"] == 1
    rep = json.loads(sessions["files2"]["report.json"])
    assert [r["step"] for r in rep["steps"]] == [0, 1, 2] and rep["sessions"] == 2, rep["steps"]
    assert rep["steps"][:2] == first["steps"]  # the first session's steps, as they were
    assert rep["steps"][2]["t_end"] > first["wall_s"]  # drawn after the first session
    assert rep["wall_s"] > first["wall_s"] and rep["version"] == 3
    for k, n in first["executions"].items():  # counts add up over the sessions
        assert rep["executions"][k] >= n
    assert sum(rep["executions"].values()) > sum(first["executions"].values())
    for c in rep["cells"]:  # each cell's time covers both sessions
        assert c["wall_s"] == pytest.approx(rep["wall_s"])
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "train/loss" in m] == [0, 1, 2]
    check_ledger(run_dir)


def test_a_finished_run_resumed_is_left_unchanged(sessions):
    assert "0 steps to go" in sessions["out3"], sessions["out3"][-2000:]
    before, after = sessions["files2"], sessions["files3"]
    assert json.loads(after["report.json"]) == json.loads(before["report.json"])
    assert after["gantt.png"] == before["gantt.png"] and after["reward.png"] == before["reward.png"]
    assert sessions["val_ws2"] == val_workspaces(sessions["dir"])  # no validation round redone either


def test_gyre_run_validates_at_start_every_step_and_at_the_end_with_a_reward_function(sessions):
    run_dir, out = sessions["dir"], sessions["out1"] + sessions["out2"]
    rounds = {r["round"]: r for r in report(run_dir)["validation"]}
    assert set(rounds) == {"v0", "v1", "v2", "v3"}, rounds.keys()
    assert {r["round"] for r in sessions["first"]["validation"]} == {"v0", "v1", "v2"}  # start, mid-run, end
    for r in rounds.values():
        assert r["executions"] == 4 and r["unscored"] == 0 and set(r["parts"]) == {"tests", "brevity", "truncation"}
        assert f"gyre: validation {r['round']}: pass@1 " in out
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [m for m in metrics if "val/pass@1" in m]
    assert sorted(m["step"] for m in val) == [0, 1, 2, 3] and all("val/reward/brevity" in m for m in val)
    # training executions were scored by the reward function, validation ones never trained
    rows = check_ledger(run_dir)
    assert rows and all(not r["execution"].startswith("val") for r in rows)
    rewards = [json.loads(x) for x in (run_dir / "rewards.jsonl").read_text().splitlines()]
    recs = list(iter_executions(run_dir / "shards"))
    assert len(rewards) == len(recs) + 4 * 4 and not any(r["error"] for r in rewards)  # trained + validation
    assert recs and {r.reward_source for r in recs} <= {"reward", "reward-after-timeout"}


def test_a_resumed_run_does_not_redo_finished_rounds(sessions):
    assert sessions["val_rounds1"] == {"v0", "v1", "v2"}
    out2 = sessions["out2"]
    assert "gyre: validation v2:" not in out2 and "gyre: validation v3:" in out2
    before, after = sessions["val_ws1"], sessions["val_ws2"]
    assert before < after and {n.split("-")[0] for n in after - before} == {"val3"}
    assert {r["round"] for r in report(sessions["dir"])["validation"]} == {"v0", "v1", "v2", "v3"}
