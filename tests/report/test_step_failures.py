"""A crashed execution on the console's step line: a harness failure, never a reward sample.

The head scores a harness that failed or crashed by itself (its workspace gets a 0) but never
trains it (gyre.services.rollout.harness_broke); the step line used to count that 0 in the reward's
mean and n, so a step of crashes read as "reward 0.000 (n 4)". Here the events are the ones the
head emits for such an execution (gyre.head.execution_scored: the record's reward, `usable` false)."""

from __future__ import annotations

import io
import math

from gyre.events import ExecutionEvaluated, ExecutionStarted, GroupLag, RunStarted, RunStats, StepEnded
from gyre.head import _reward_of
from gyre.report.metrics import row_scalars
from gyre.report.progress import Progress
from gyre.traj.record import ExecutionRecord, Status, limit_of


def evaluated(t: float, eid: str, status: str, reward: float, error: str | None = None) -> ExecutionEvaluated:
    """What the head emits for an execution that ended with `status` and was scored `reward`."""
    rec = ExecutionRecord(eid, "sum", 0, status=status, reward=reward, error=error)
    r, usable = _reward_of(rec)
    return ExecutionEvaluated(t, eid, 0, status, r, 0, 40.0, usable, limit_of(rec.error))


def step(evals: list[ExecutionEvaluated], st: RunStats | None = None) -> dict:
    st = st if st is not None else RunStats()
    row = None
    for ev in [RunStarted(0.0, 1), *(ExecutionStarted(0.0, e.execution, 0, "sum") for e in evals), *evals,
               StepEnded(0.0, 20.0, 0, 1, (GroupLag(0, 0, 0, 0, 160.0),), (), (0,), True)]:
        row = st.apply(ev) or row
    return row


CRASH = "harness exited 3; stderr: ValueError: the harness bug (logs/q0-sum-g2/harness.stderr)"


def test_crashed_executions_are_failures_on_the_step_line_not_reward_samples():
    row = step([evaluated(1, "q0-sum-g0", Status.DONE, 1.0), evaluated(2, "q0-sum-g1", Status.DONE, 1.0),
                evaluated(3, "q0-sum-g2", Status.FAILED, 0.0, CRASH),
                evaluated(4, "q0-sum-g3", Status.CRASHED, 0.0, "harness killed by SIGSEGV; stderr: (empty) (x)")])
    assert row["reward_n"] == 2 and row["reward_mean"] == 1.0 and row["reward_by_task"] == {"sum": 1.0}
    assert row["harness_failures"] == 2 and row["harness_failure_rate"] == 0.5 and row["executions_ended"] == 4
    line = Progress(1, 4, out=io.StringIO()).step_line(row)
    assert "reward 1±0 (n 2)  2 harness failures  exec 4 done" in line, line
    assert row_scalars(row)["rollout/harness_failures"] == 2.0


def test_a_step_of_crashes_shows_no_reward_and_the_failures():
    row = step([evaluated(1, f"q0-sum-g{k}", Status.FAILED, 0.0, CRASH) for k in range(3)])
    assert row["reward_n"] == 0 and row["reward_mean"] is None and row["reward_by_task"] == {}
    line = Progress(1, 3, out=io.StringIO()).step_line(row)
    assert "reward -  3 harness failures" in line, line


def test_a_limit_or_time_limit_is_the_policys_outcome_a_sample_not_a_harness_failure():
    limit = "harness.max_processes = 50 passed: 51 processes"
    st = RunStats()
    row = step([evaluated(1, "q0-sum-g0", Status.FAILED, 0.0, limit),
                evaluated(2, "q0-sum-g1", Status.TIMEOUT, 0.5, "wall-clock limit of 5s reached"),
                evaluated(3, "q0-sum-g2", Status.DONE, 1.0),
                evaluated(4, "q0-sum-g3", Status.CRASHED, 0.0, CRASH)], st)
    # the report's harness_errors (gyre.report.session) counts the crash, not the limit's failure
    assert st.status_counts["failed"] == 1 and st.harness_broke == 1
    assert row["reward_n"] == 3 and math.isclose(row["reward_mean"], 0.5)
    assert row["harness_failures"] == 1 and row["harness_failure_rate"] == 0.25
    assert row["stopped_by_limits"] == {"max_processes": 1}  # told as what it is
    assert "1 harness failure" in Progress(1, 4, out=io.StringIO()).step_line(row)
