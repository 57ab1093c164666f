"""gyre/events.py: the run's typed events and the one place that computes its statistics.

The head is driven through its real handlers (core, ledger, HDF5 shards, materializer; only the
cell agents and harnesses are absent), and what the events give is checked against what the head
computed before the events existed: step rows from the core's step results and the records, lag
from the core's group records (tests/support/lag_oracle.py), per-cell time from the old cell book's own logs (`cell_stats`, kept
here as the oracle) over the calls read back from the shards."""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
from dataclasses import asdict
from types import SimpleNamespace

import pytest

from gyre.events import (CallRecorded, CellBusy, CellRoleChanged, ExecutionDropped, ExecutionEvaluated,
                         ExecutionStarted, GroupLag, MicroBatchDone, RunEnded, RunStarted, RunStats, StepEnded,
                         WeightsPushed, bucket_seconds, summarise)
from gyre.sched.cells import Cell
from gyre.sched.state import Role
from gyre.sched.protocol import ReduceReply
from gyre.services.training import StepReduced
from support.replay_head import NOTHING_REDUCED, execution_done, run_config, set_clock
from support.lag_oracle import lag_of
from support.head_records import LoggedCell, make_head, record


def cell_stats(cell: Cell, t0: float, t1: float, rollout_busy: list[tuple[float, float]]) -> dict:
    """Seconds in each role, switching, and idle (a settled cell with no work) over [t0, t1]."""
    role_s = {r.value: 0.0 for r in Role}
    for role, a, b in cell.intervals:
        a, b = max(a, t0), min(b, t1)
        if b > a:
            role_s[role] += b - a
    busy_train = _overlap(cell.busy_intervals, [(a, b) for r, a, b in cell.intervals if r == "train"])
    busy_roll = _overlap(rollout_busy, [(a, b) for r, a, b in cell.intervals if r == "rollout"])
    switching = role_s["to_train"] + role_s["to_rollout"]
    wall = t1 - t0
    idle = max(0.0, role_s["train"] - busy_train) + max(0.0, role_s["rollout"] - busy_roll)
    return {"cell": cell.id, "hostname": cell.hostname, "wall_s": wall, "rollout_s": role_s["rollout"],
            "train_s": role_s["train"], "switching_s": switching, "failed_s": role_s["failed"],
            "busy_rollout_s": busy_roll, "busy_train_s": busy_train, "idle_s": idle,
            "switches": cell.switches, "utilisation": (busy_roll + busy_train) / wall if wall > 0 else 0.0}


def _overlap(work: list[tuple[float, float]], windows: list[tuple[float, float]]) -> float:
    total = 0.0
    for a, b in _merge(work):
        for c, d in windows:
            lo, hi = max(a, c), min(b, d)
            if hi > lo:
                total += hi - lo
    return total


def _merge(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def train_reply(ok: bool = True, loss: float = 0.0):
    from gyre.sched.protocol import TrainReply

    return TrainReply(seq=0, cell=1, ok=ok, stats={"loss": loss, "ratio_mean": 1.0 + loss, "kl_old": abs(loss)})


def play(head, steps: int, rng: random.Random, monkeypatch, t0: float = 1000.0):
    """Drive the head's handlers through `steps` on-policy steps; returns what it was told. The
    head's clock is the test's (training a micro-batch takes 2 s of it)."""
    from gyre.events import RunStarted as RS

    clock = SimpleNamespace(now=t0)
    set_clock(head, lambda: clock.now)
    told = {"records": {}, "losses": {}}
    head.t0 = t0
    head._emit(RS(t0, 2))
    for c in head.cells:
        head._emit(CellRoleChanged(t0, c.id, c.role.value))
    rollout, trainer = head.cells
    now = t0
    head.fleet.set_role(trainer, Role.TO_TRAIN, now)
    now += 3.0
    head.fleet.set_role(trainer, Role.TRAIN, now)
    for _ in range(steps):
        for g in head.start_groups(head.core.spec.groups_per_step, now):
            for m in range(head.core.spec.group_size):
                eid = f"q{g.id}-task-g{m}"
                failed = rng.random() < 0.2
                rec = record(eid, g.id, m, head.core.rollout_version, now + 0.5 * m, rollout.engine_url,
                             status="failed" if failed else "done",
                             reward=float("nan") if failed and m % 2 else None)
                told["records"][eid] = rec
                execution_done(head, eid, rec, now + 12.0 + m)
        now += 20.0
        clock.now = now
        while (mb := head.core.next_microbatch()) is not None:
            loss = rng.uniform(-1e-4, 1e-4)
            told["losses"][mb] = loss

            async def train(cell, step, mid, batch, update=0, _loss=loss):
                clock.now += 2.0
                cell.busy_intervals.append((clock.now - 2.0, clock.now))  # the oracle's own record
                return train_reply(loss=_loss)

            head.fleet.train = train
            asyncio.run(head.training.train(trainer, mb))
        now = clock.now + 1.0
        head.core.step_ending(now)
        res = head.step_ended(now)
        head.step_committed(res, StepReduced([trainer], [ReduceReply(seq=0, cell=1, grad_norm=0.25)], 1.5), 0.0)
        now += 1.0
    return now, told


def old_step_row(res, records, losses, t0) -> dict:
    """The row the head built itself before gyre/events.py (kept here as the oracle), less the
    scores of harnesses that failed by themselves: never trained, so no reward sample (issue 45)."""
    from gyre.services.rollout import harness_broke

    rewards = [r.reward for g in res.groups for eid in g.executions
               if math.isfinite((r := records[eid]).reward) and not harness_broke(r)]
    ls = [losses[m] for m in res.microbatches]
    lag = [g.lag_steps for g in res.groups]
    toks = [g.train_tokens for g in res.groups]
    return {"step": res.index, "version": res.version, "groups": len(res.groups),
            "reward_mean": statistics.fmean(rewards) if rewards else None, "reward_n": len(rewards),
            "staleness_mean": statistics.fmean(lag) if lag else 0, "staleness_max": max(lag, default=0),
            "staleness_token_mean": sum(a * b for a, b in zip(lag, toks)) / sum(toks) if sum(toks) else 0,
            "loss": sum(ls), "t_start": (res.started_at or res.ended_at) - t0, "t_end": res.ended_at - t0}


def test_step_rows_lag_and_cell_time_from_events_equal_what_the_head_computed(tmp_path, monkeypatch):
    from gyre.traj.store import iter_executions

    head = make_head(tmp_path, run_config(tmp_path, steps=4, q=2, g=3, per_shard=1, skip_zero_variance=False))
    t1, told = play(head, 4, random.Random(7), monkeypatch)
    for c in head.cells:
        c.close(t1)
    rep = head.report(t1, False)
    assert len(rep["steps"]) == 4
    for res, row in zip(head.core.steps, rep["steps"]):
        want = old_step_row(res, told["records"], told["losses"], head.t0)
        assert {k: row[k] for k in want} == pytest.approx(want)
        assert row["grad_norm"] == 0.25 and row["participants"] == [1]
    # steps.jsonl carries exactly the rows of the report
    head.ledger.close()
    assert [json.loads(x) for x in (tmp_path / "steps.jsonl").read_text().splitlines()] == rep["steps"]
    assert rep["lag"] == asdict(lag_of(head.core))
    # cell time: the old computation read every call back from the shards
    by_url: dict[str, list] = {}
    for rec in iter_executions(tmp_path / "shards"):
        for call in rec.tree.calls:
            by_url.setdefault(call.endpoint, []).append((call.t_start, call.t_end))
    for c, got in zip(head.cells, rep["cells"]):
        want = cell_stats(c, head.t0, t1, by_url.get(c.engine_url, []))
        assert {k: got[k] for k in want if k != "hostname"} == pytest.approx({k: v for k, v in want.items()
                                                                             if k != "hostname"})
        parts = got["busy_rollout_s"] + got["busy_train_s"] + got["switching_s"] + got["idle_s"] + got["failed_s"]
        assert parts == pytest.approx(got["wall_s"])
        assert sum(b - a for a, b in rep["idle"][str(c.id)]) == pytest.approx(got["idle_s"])
    assert rep["cells"][0]["busy_rollout_s"] > 0 and rep["cells"][1]["busy_train_s"] > 0
    assert rep["executions"] == {s: sum(r.status == s for r in told["records"].values())
                                 for s in {r.status for r in told["records"].values()}}


def test_a_record_leaves_memory_once_its_shard_is_durable_and_its_group_materialized(tmp_path):
    # k = 1: two groups run for step 0; the second waits in the admission queue until step 1
    head = make_head(tmp_path, run_config(tmp_path, steps=2, q=1, g=2, k=1, per_shard=100, skip_zero_variance=False))
    started = head.start_groups(2, 0.0)
    assert [g.id for g in started] == [0, 1]
    for g in started:
        for m in range(2):
            eid = f"q{g.id}-task-g{m}"
            execution_done(head, eid, record(eid, g.id, m, 0, 1.0, head.cells[0].engine_url), 10.0 + g.id)
    # every record is durable as soon as it ends (its own small shard); group 0 was materialized
    # (its micro-batches hold what training needs) and left memory; group 1 still waits
    assert len(list((tmp_path / "shards").glob("*.h5"))) == 4
    assert set(head.training.records) == {"q1-task-g0", "q1-task-g1"}
    while (mb := head.core.next_microbatch()) is not None:
        head.core.microbatch_trained(mb)
    head.core.step_ending(20.0)
    res = head.step_ended(20.0)
    head.step_committed(res, NOTHING_REDUCED, 0.0)  # step 1 takes group 1: materialized, then freed
    assert head.core.groups[1].state.value == "assigned" and head.core.step.work
    assert head.training.records == {}
    # what the ledger still needs is a small summary, gone with the execution's last line
    assert set(head.ledger.ended) == {"q1-task-g0", "q1-task-g1"}
    head.ledger.close_unfinished(head.core.unfinished(), "run stopped", head.core.step.index)
    assert head.ledger.ended == {}
    head.ledger.close()
    rows = [json.loads(x) for x in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert sorted(r["execution"] for r in rows) == ["q0-task-g0", "q0-task-g1", "q1-task-g0", "q1-task-g1"]
    assert [r["reward"] for r in rows if r["execution"] == "q1-task-g1"] == [0.5]


def test_cell_time_adds_up_and_matches_the_cell_book_on_random_histories():
    rng = random.Random(3)
    for _ in range(30):
        t0, now = 100.0, 100.0
        cell, ev = LoggedCell(0, 1), [RunStarted(100.0, 1), CellRoleChanged(100.0, 0, "rollout")]
        cell.since = t0
        calls, train = [], []
        for _ in range(rng.randint(1, 8)):
            role = rng.choice([Role.ROLLOUT, Role.TRAIN, Role.TO_TRAIN, Role.TO_ROLLOUT, Role.FAILED])
            span = rng.uniform(1, 50)
            if cell.role is Role.ROLLOUT:
                for _ in range(rng.randint(0, 6)):
                    a = rng.uniform(now, now + span)
                    calls.append((a, min(a + rng.uniform(0, 10), now + span)))
            elif cell.role is Role.TRAIN:
                for _ in range(rng.randint(0, 4)):
                    a = rng.uniform(now, now + span)
                    train.append((a, min(a + rng.uniform(0, 8), now + span)))
            now += span
            if role is not cell.role:
                ev.append(CellRoleChanged(now, 0, role.value))
            cell.set_role(role, now)
        t1 = now + rng.uniform(0, 20)
        cell.close(t1)
        cell.busy_intervals = train
        ev += [CallRecorded(a, b, 0) for a, b in calls]
        ev += [MicroBatchDone(a, b, 0, i, 0, True) for i, (a, b) in enumerate(train)]
        ev.append(RunEnded(t1))
        rng.shuffle(ev[2:-1])  # calls are told when their execution ends, in any order
        ev[2:-1] = sorted(ev[2:-1], key=lambda e: 0 if isinstance(e, CellRoleChanged) else 1)  # roles in order
        got = summarise(ev)["cells"][0]
        want = cell_stats(cell, t0, t1, calls)
        assert {k: got[k] for k in want if k != "hostname"} == pytest.approx({k: v for k, v in want.items()
                                                                             if k != "hostname"})
        total = got["busy_rollout_s"] + got["busy_train_s"] + got["switching_s"] + got["idle_s"] + got["failed_s"]
        assert total == pytest.approx(t1 - t0)


def test_stats_are_flat_per_execution_and_name_a_foreign_event():
    s = RunStats(0.0, 1)
    for gid in range(200):
        s.apply(ExecutionStarted(1.0, f"e{gid}", gid))
        s.apply(ExecutionEvaluated(2.0, f"e{gid}", gid, "done", 1.0, 0, 10.0, True))
        s.apply(StepEnded(2.0, 3.0, gid, gid + 1, (GroupLag(gid, gid, 0, 0, 10.0),), (gid,)))
    assert s._rewards == {} and s._mb == {}  # nothing per execution outlives its step
    assert s.lag().groups == 200 and s.steps[-1]["reward_mean"] == 1.0
    with pytest.raises(TypeError, match="dict is not a gyre.events event"):
        s.apply({"kind": "step"})
    with pytest.raises(ValueError, match="role 'resting'"):
        s.apply(CellRoleChanged(1.0, 0, "resting"))


def test_busy_stretches_and_weight_pushes_book_a_cells_time():
    """CellBusy counts as calls and micro-batches do; a push pauses the rollout cells (neither busy
    nor idle); the buckets still add up to the wall time; drops are counted per reason."""
    ev = [RunStarted(0.0, 2), CellRoleChanged(0.0, 0, "rollout"), CellRoleChanged(0.0, 1, "train"),
          CellBusy(0.0, 4.0, 0, "rollout"), CellBusy(3.0, 6.0, 0, "rollout"),  # merged: 0-6
          CellBusy(1.0, 5.0, 1, "train"), WeightsPushed(7.0, 9.0, 1), CellBusy(9.0, 10.0, 0, "rollout"),
          ExecutionDropped(9.0, "e0", 0, "stale"), ExecutionDropped(9.0, "e1", 0, "stale"),
          CellRoleChanged(10.0, 1, "to_rollout"), CellRoleChanged(11.0, 1, "rollout"), RunEnded(12.0)]
    s = RunStats().extend(ev)
    c0, c1 = s.cell_time(0), s.cell_time(1)
    assert (c0["busy_rollout_s"], c0["pushing_s"], c0["idle_s"]) == (7.0, 2.0, 3.0)
    assert (c1["busy_train_s"], c1["switching_s"], c1["pushing_s"], c1["idle_s"]) == (4.0, 1.0, 0.0, 7.0)
    assert c1["switches"] == c1["switches_to_rollout"] == 1 and c1["switches_to_train"] == 0
    for c in (c0, c1):
        assert sum(bucket_seconds(c).values()) + c["failed_s"] == c["wall_s"] == 12.0
    assert bucket_seconds(c0) == {"rollout": 7.0, "train": 0.0, "switch": 2.0, "idle": 3.0}
    assert s.idle_spans(0) == [(6.0, 7.0), (10.0, 12.0)]  # the push is not idle
    assert s.dropped_reasons == {"stale": 2}
    with pytest.raises(ValueError, match="CellBusy"):
        s.apply(CellBusy(0.0, 1.0, 0, "to_train"))


def test_the_step_rows_trainer_means_are_weighted_by_target_tokens():
    """gyre.events.step_row is the one builder of the step row; a micro-batch of 3 targets counts
    three times one of 1 in every trainer mean (issue 41: ratio_mean was an unweighted mean while
    clip_frac was target-weighted). An unweighted mean reads 1.5 here, the weighted one 1.75."""
    from gyre.events import TARGET_MEANS

    st = RunStats()
    st.apply(RunStarted(0.0, 1))
    small = {"loss": 1.0, "targets": 1, "kl_old": 0.1, **{k: 1.0 for k in TARGET_MEANS}}
    big = {"loss": 5.0, "targets": 3, "kl_old": 0.3, **{k: 2.0 for k in TARGET_MEANS}}
    st.apply(MicroBatchDone(0.0, 1.0, 0, 0, 0, True, small))
    st.apply(MicroBatchDone(1.0, 2.0, 0, 1, 0, True, big))
    st.apply(MicroBatchDone(2.0, 3.0, 0, 2, 0, False, {}))  # lost: no figures
    row = st.apply(StepEnded(0.0, 3.0, 0, 1, (GroupLag(0, 0, 0, 0, 4.0),), (0, 1, 2), (0,)))
    for k in TARGET_MEANS:
        assert row[k] == pytest.approx(1.75), k
    assert row["loss"] == 6.0 and row["loss_per_target"] == pytest.approx(1.5)  # summed loss / summed targets
    assert row["kl_old_max"] == 0.3
    bare = RunStats()  # a driver without trainer figures (the simulator): no MoE key, the means None
    row = bare.apply(StepEnded(0.0, 1.0, 0, 1, (GroupLag(0, 0, 0, 0, 4.0),)))
    assert row["ratio_mean"] is None and row["loss_per_target"] is None and "moe_aux_loss" not in row
