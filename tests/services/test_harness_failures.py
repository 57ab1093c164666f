"""Harness failures are told, not trained.

A harness that crashes by itself (a bug in it, not the policy's answer) used to be scored 0 and
trained on, and at 100% crashes every step "completed" with exit 0. Now its execution is recorded
with its exit status and stderr's end, never trains, and past run.warn_harness_failure_rate for
run.stop_harness_failure_steps steps the run stops, non-zero, saying why.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gyre.services.rollout import harness_broke
from gyre.traj.record import Status
from support.gyre_run import gyre_run, ledger

# the demo's agent makes its calls (trajectories that could train), then the harness crashes on its own bug
CRASH = ("import sys; from gyre.harness.answer_agent import main; main(); "
         "print('agent: ValueError: the harness bug', file=sys.stderr); sys.exit(3)")


def test_a_broken_harness_is_told_from_a_limit_or_a_clean_end():
    rec = SimpleNamespace(status=Status.FAILED, error="harness exited 3; stderr: boom (logs/x/harness.stderr)")
    assert harness_broke(rec) == "harness failed: exited 3; stderr: boom (logs/x/harness.stderr)"
    assert harness_broke(SimpleNamespace(status=Status.CRASHED, error=None)) == "harness crashed"
    # a limit the policy's work passed is the policy's outcome: it trains
    assert harness_broke(SimpleNamespace(status=Status.FAILED, error="harness.max_processes = 50 passed: 51")) == ""
    assert harness_broke(SimpleNamespace(status=Status.DONE, error=None)) == ""
    assert harness_broke(SimpleNamespace(status=Status.TIMEOUT, error="wall-clock limit of 5s reached")) == ""


@pytest.mark.e2e
@pytest.mark.slow
def test_a_harness_that_always_crashes_stops_the_run_and_nothing_trains(tmp_path):
    run_dir = tmp_path / "c"
    rc, out = gyre_run(run_dir, f'harness.command=["{{python}}", "-c", "{CRASH}"]', "harness.group_size=2",
                       "run.stop_harness_failure_steps=2", "sched.skip_zero_variance=false", "sched.cells=1", steps=4, timeout=400)
    assert rc != 0, out[-3000:]
    assert "run.stop_harness_failure_steps=2" in out, out[-3000:]
    steps = [ln for ln in out.splitlines() if ln.startswith("gyre: step ")]
    # the console's step line tells the crashes as failures, never as reward samples (a 0 of n 2)
    assert steps and all("reward -  " in ln and " harness failure" in ln for ln in steps), steps
    told = [ln for ln in out.splitlines() if " not trained: harness failed: exited 3" in ln]
    assert told and "the harness bug" in told[0], out[-3000:]
    rows = ledger(run_dir)
    assert rows, out[-3000:]
    crash_rewards_trained = sum(1 for r in rows if r["admitted"])
    assert crash_rewards_trained == 0, [r for r in rows if r["admitted"]][:2]
    assert all(r["reason"].startswith("harness failed: exited 3") and "the harness bug" in r["error"]
               for r in rows if r["reason"] != "run stopped" and not r["reason"].startswith("run ")), rows[:3]
