"""gyre/report/history.py: the whole run's report across sessions (a run resumed is many heads).

Two sessions told as events are folded; the fold must agree with one RunStats that saw every
event (lag, cell seconds, counts), keep the steps the ledger kept, move the later session's times
after the earlier's, and leave the history untouched when a session did no work."""

from __future__ import annotations

import json
from dataclasses import asdict

from gyre.events import (CallRecorded, CellRoleChanged, ExecutionEvaluated, ExecutionStarted, GroupLag, RunStarted,
                         RunStats, StepEnded)
from gyre.report.history import HISTORY, fold, whole_run


def events(t0: float, first_step: int, steps: int, first_group: int) -> list:
    """`steps` steps of one group each, two executions a group, on two cells (0 rollout, 1 train)."""
    out = [RunStarted(t0, 2), CellRoleChanged(t0, 0, "rollout"), CellRoleChanged(t0, 1, "train")]
    t = t0
    for k in range(steps):
        g = first_group + k
        for m in range(2):
            eid = f"q{g}-t-g{m}"
            out += [ExecutionStarted(t, eid, g, "t"), CallRecorded(t, t + 3, 0, eid, 10, 5),
                    ExecutionEvaluated(t + 4, eid, g, "done" if m else "failed", float(m), first_step + k,
                                       20.0 + 30 * m, True)]
        tokens = 50.0 * (k + 1)  # groups of unequal size: a group-weighted and a token-weighted mean differ
        out.append(StepEnded(t + 5, t + 8, first_step + k, first_step + k + 1,
                             (GroupLag(g, first_step + k - (k % 2), k % 2, 0, tokens),), (), (1,), False, 0.5, 0.0,
                             1.0))
        t += 10
    return out


def session(evs: list, t1: float, first_step: int) -> dict:
    """A session's report as gyre.report.session builds it from the head's RunStats."""
    st = RunStats().extend(evs)
    ex = dict(st.status_counts)
    return {"t0": st.t0, "wall_s": t1 - st.t0, "label": "sync0", "steps": st.steps, "lag": asdict(st.lag()),
            "cells": [{**st.cell_time(c, t1), "hostname": "h", "switch_phases": []} for c in st.cell_ids()],
            "executions": ex, "unscorable": {}, "stopped_by_limits": {}, "groups_dropped": st.groups_dropped,
            "groups_started": len(st.steps), "harness_errors": ex.get("failed", 0), "events": [],
            "groups_replaced_zero_variance": 0, "errors": [], "warnings": [], "failed": None, "stopped": False,
            "version": first_step + len(st.steps),
            "intervals": {c: st.intervals(c, t1) for c in st.cell_ids()},
            "idle": {c: st.idle_spans(c, t1) for c in st.cell_ids()}}


def test_two_sessions_fold_like_one_run_that_saw_every_event():
    a = events(1000.0, 0, 3, 0)
    b = events(1030.0, 3, 2, 3)  # the second session starts where the first ended: no gap to squeeze
    whole = RunStats().extend(a + b[3:])  # one RunStarted, the roles set once
    s1, s2 = session(a, 1030.0, 0), session(b, 1050.0, 3)
    out = fold(fold(None, s1, 0), s2, 3)
    assert [r["step"] for r in out["steps"]] == [0, 1, 2, 3, 4]
    assert out["wall_s"] == 50.0 and out["sessions"] == 2
    assert [r["t_end"] for r in out["steps"]] == [r["t_end"] for r in whole.steps]
    want = asdict(whole.lag())
    for k, v in want.items():  # token-weighted means need the tokens: a group-weighted fold fails here
        assert abs(out["lag"][k] - v) < 1e-9, (k, out["lag"][k], v)
    assert out["executions"] == {"done": 5, "failed": 5} and out["harness_errors"] == 5
    for c in (0, 1):
        one = whole.cell_time(c, 1050.0)
        got = next(x for x in out["cells"] if x["cell"] == c)
        for k in ("wall_s", "busy_rollout_s", "busy_train_s", "idle_s", "rollout_s", "train_s"):
            assert abs(got[k] - one[k]) < 1e-9, (c, k)
        assert abs(got["utilisation"] - one["utilisation"]) < 1e-9
    assert out["intervals"][1][-1][2] == 1050.0  # absolute, in the first session's clock


def test_a_later_session_is_drawn_after_the_earlier_one_without_the_gap():
    s1 = session(events(1000.0, 0, 2, 0), 1020.0, 0)
    s2 = session(events(90_000.0, 2, 1, 2), 90_010.0, 2)  # requeued a day later
    out = fold(fold(None, s1, 0), s2, 2)
    assert out["steps"][-1]["t_end"] == 20.0 + 8.0
    assert min(a for _, a, _ in out["intervals"][0][1:]) >= 1020.0
    assert max(b for _, _, b in out["intervals"][0]) == 1030.0


def test_steps_rolled_back_are_dropped_and_a_killed_sessions_rows_kept():
    s1 = session(events(1000.0, 0, 3, 0), 1030.0, 0)
    killed_row = {**s1["steps"][0], "step": 3, "t_start": 1.0, "t_end": 2.0}
    s3 = session(events(2000.0, 4, 1, 9), 2010.0, 4)
    # history ends at step 2; a session killed hard committed step 3 (steps.jsonl has it, no report)
    out = fold(fold(None, s1, 0), s3, 4, [*s1["steps"], killed_row])
    assert [r["step"] for r in out["steps"]] == [0, 1, 2, 3, 4]
    assert out["steps"][3]["t_end"] == 30.0 + 2.0
    rolled = fold(fold(None, s1, 0), session(events(2000.0, 2, 1, 9), 2010.0, 2), 2)
    assert [r["step"] for r in rolled["steps"]] == [0, 1, 2]  # step 2 was redone: once


def test_a_session_that_did_no_work_leaves_the_history_byte_for_byte(tmp_path):
    s1 = session(events(1000.0, 0, 2, 0), 1020.0, 0)
    first = whole_run(tmp_path, s1, 0)
    before = (tmp_path / HISTORY).read_bytes()
    idle = session([RunStarted(5000.0, 2), CellRoleChanged(5000.0, 0, "rollout")], 5001.0, 2)
    again = whole_run(tmp_path, idle, 2)
    assert json.dumps(again) == json.dumps(first)
    assert (tmp_path / HISTORY).read_bytes() == before
    failed = whole_run(tmp_path, {**idle, "failed": "boom", "errors": ["boom"]}, 2)
    assert failed["failed"] == "boom" and failed["errors"] == ["boom"] and failed["sessions"] == 2
