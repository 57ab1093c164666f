"""Each policy on small hand-built situations (pure functions: state in, decision out)."""

from __future__ import annotations

import itertools
import random

import pytest

from gyre.sched import (CellView, ClusterState, ExecView, GroupView, Hints, Role, make_policy,
                        start_budget)
from gyre.sched.admission import admissible, expired, fifo_key, oldest_version_key, pick
from gyre.sched.policy import cell_counts, heading_counts

HINTS = Hints(train_tokens_per_s=2200, calls_per_cell=4)


def state(roles, running=0, train_left=0.0, version=3, k=0, open_=None, step_groups=0, q=4, g=4,
          now=10_000.0, since=0.0, blocked=False, calls=0) -> ClusterState:
    cells = tuple(CellView(i, r, since) for i, r in enumerate(roles))
    execs = tuple(ExecView(i, i // g, version, now - 60 * (i + 1)) for i in range(running))
    return ClusterState(version=version, staleness=k, groups_per_step=q, group_size=g, cells=cells,
                        running=execs, groups_open=(running + g - 1) // g if open_ is None else open_,
                        groups_waiting=0, step_groups=step_groups, train_tokens_left=train_left,
                        starts_blocked=blocked, calls_in_flight=calls)


def apply(st: ClusterState, switches) -> list[Role]:
    roles = [c.role for c in st.cells]
    for s in switches:
        assert roles[s.cell].settled, "a policy switched a cell that was mid-switch"
        roles[s.cell] = Role.TO_TRAIN if s.to is Role.TRAIN else Role.TO_ROLLOUT
    return roles


R, T, TT, TR = Role.ROLLOUT, Role.TRAIN, Role.TO_TRAIN, Role.TO_ROLLOUT
LAYOUTS = [list(p) for p in itertools.product([R, T, TT, TR], repeat=4)]


@pytest.mark.parametrize("scheme", ["E", "E-paper"])
def test_elastic_never_leaves_running_executions_unserved(scheme):
    """Whatever the layout and the work: after the decision at least one settled rollout cell
    remains (or one is on its way when none was left), and a lone rollout cell never leaves."""
    p = make_policy(scheme, 0, HINTS)
    for roles, running, left in itertools.product(LAYOUTS, [1, 5, 40], [0.0, 1e6, 1e9]):
        st = state(roles, running=running, train_left=left, open_=4)
        d = p.decide(st, 10_000.0)
        after = apply(st, d.switches)
        settled = sum(r is R for r in after)
        heading = sum(r in (R, TR) for r in after)
        if any(r.settled for r in roles):  # a mid-switch cell cannot be turned around
            assert heading >= 1, (roles, running, left, d)
        if any(r is R for r in roles):
            assert settled >= 1, (roles, running, left, d)


@pytest.mark.parametrize("scheme", ["E", "E-paper"])
def test_elastic_moves_idle_capacity_to_admitted_work_and_back(scheme):
    p = make_policy(scheme, 0, HINTS)
    # Two executions left, lots of admitted work: cells go to training, one keeps serving.
    st = state([R] * 8, running=2, train_left=5e8, open_=4)
    d = p.decide(st, 10_000.0)
    after = apply(st, d.switches)
    assert sum(r is TT for r in after) >= 4 and sum(r is R for r in after) >= 1
    # A new step starts (budget for 4 groups = 16 executions) with every cell training: cells come back.
    st = state([T] * 8, running=0, train_left=0.0, open_=0)
    d = p.decide(st, 10_000.0)
    assert sum(s.to is R for s in d.switches) >= 1
    assert d.start_groups == 0  # not before a rollout cell has arrived to serve them
    st = state([R] + [T] * 7, running=0, train_left=0.0, open_=0)
    assert p.decide(st, 10_000.0).start_groups == 4


@pytest.mark.parametrize("scheme", ["E", "E-paper"])
def test_elastic_respects_dwell_time(scheme):
    p = make_policy(scheme, 0, HINTS)
    st = state([R] * 8, running=2, train_left=5e8, open_=4, since=10_000.0 - 10)  # arrived 10 s ago
    assert p.decide(st, 10_000.0).switches == ()


def test_async_never_switches():
    rng = random.Random(1)
    p = make_policy("A", 1, HINTS, rollout_cells=3)
    assert p.initial_roles(8) == [R] * 3 + [T] * 5
    for _ in range(300):
        roles = [rng.choice([R, T]) for _ in range(8)]
        st = state(roles, running=rng.randrange(0, 50), train_left=rng.choice([0.0, 1e8]), k=1,
                   open_=rng.randrange(0, 9))
        assert p.decide(st, rng.uniform(0, 1e6)).switches == ()


def test_async_needs_both_pools():
    with pytest.raises(ValueError):
        make_policy("A", 0, HINTS, rollout_cells=4).initial_roles(4)


def test_colocate_never_splits():
    rng = random.Random(2)
    p = make_policy("C", 2, HINTS)
    for _ in range(500):
        base = rng.choice([R, T, TT, TR])
        roles = [base] * 6
        st = state(roles, running=rng.randrange(0, 30), train_left=rng.choice([0.0, 1e8]), k=2,
                   step_groups=rng.choice([0, 2, 4]), open_=rng.randrange(0, 13))
        d = p.decide(st, 1.0)
        assert len(d.switches) in (0, 6), d
        assert len({s.to for s in d.switches}) <= 1
        after = apply(st, d.switches)
        assert len({r.heading for r in after}) == 1


def test_colocate_trains_only_a_complete_batch():
    p = make_policy("C", 0, HINTS)
    partial = state([R] * 4, running=8, train_left=1e8, step_groups=3)
    assert p.decide(partial, 0.0).switches == ()
    full = state([R] * 4, running=0, train_left=1e8, step_groups=4, open_=4)
    assert {s.to for s in p.decide(full, 0.0).switches} == {T}


@pytest.mark.parametrize("scheme", ["E", "E-paper", "A", "C"])
@pytest.mark.parametrize("k", [0, 1, 2])
def test_no_policy_starts_more_than_the_staleness_bound_allows(scheme, k):
    p = make_policy(scheme, k, HINTS, rollout_cells=2)
    for open_ in range(0, 4 * (k + 1) + 3):
        st = state([R] * 4, running=0, k=k, open_=open_)
        d = p.decide(st, 0.0)
        assert d.start_groups <= max(0, 4 * (k + 1) - open_)
    blocked = state([R] * 4, running=0, k=k, open_=0, blocked=True)
    assert p.decide(blocked, 0.0).start_groups == 0


def test_admission_rule_and_order():
    assert admissible(5, 5, 0) and not admissible(6, 5, 0) and admissible(7, 5, 2)
    assert not admissible(4, 5, 2)  # never train a version before it exists
    assert expired(8, 5, 2) and not expired(7, 5, 2)
    groups = [GroupView(0, 3, 10.0, 1.0), GroupView(1, 1, 20.0, 1.0), GroupView(2, 2, 5.0, 1.0),
              GroupView(3, 0, 1.0, 1.0)]
    assert [g.id for g in pick(groups, 3, 2, 10, fifo_key)] == [2, 0, 1]  # version 0 is too stale
    assert [g.id for g in pick(groups, 3, 2, 2, oldest_version_key)] == [1, 2]


def test_policies_are_pure():
    """Same state, same answer, and the state is not changed (frozen data)."""
    st = state([R, R, T, T], running=6, train_left=3e7, k=1, open_=3)
    for scheme in ("E", "E-paper", "A", "C"):
        p = make_policy(scheme, 1, HINTS, rollout_cells=2)
        assert p.decide(st, 5_000.0) == p.decide(st, 5_000.0)
    with pytest.raises(AttributeError):
        st.version = 4  # type: ignore[misc]


def test_start_budget_and_heading_counts():
    st = state([R, TT, T, TR], running=0, k=1, open_=5)
    assert start_budget(st) == 3
    assert heading_counts(st.cells) == (2, 2)


def test_cell_counts_follow_every_tuple_and_never_a_mutated_list():
    roles = [Role.ROLLOUT, Role.FAILED, Role.TO_TRAIN, Role.TRAIN, Role.TO_ROLLOUT, Role.ROLLOUT]
    cells = tuple(CellView(i, r, 0.0) for i, r in enumerate(roles))
    n = cell_counts(cells)
    assert (n.live, n.rollout, n.heading_rollout, n.heading_train, n.switching, n.first_live) == \
        (5, 2, 3, 2, 2, Role.ROLLOUT)
    assert cell_counts(cells) is n  # the same tuple: counted once
    other = tuple(CellView(i, Role.FAILED if i == 0 else Role.TRAIN, 0.0) for i in range(3))
    assert (cell_counts(other).live, cell_counts(other).first_live) == (2, Role.TRAIN)
    listed = list(cells)  # a list may change between decisions: counted each time
    assert cell_counts(listed).rollout == 2
    listed[0] = CellView(0, Role.TRAIN, 0.0)
    assert cell_counts(listed).rollout == 1
    assert cell_counts(cells) == n


def test_unknown_scheme_and_bad_staleness():
    with pytest.raises(ValueError, match="unknown scheme"):
        make_policy("X")
    with pytest.raises(ValueError):
        make_policy("E", -1)


def test_run_spec_policy_and_preset_defaults_agree():
    from gyre.config import load_config
    from gyre.sched import RunSpec
    from gyre.sim.calibration import P122B

    cfg = load_config(overrides=["sched.scheme=E-paper", "sched.staleness=2", "sched.to_train_s=10",
                                 "sched.rollout_cells_async=3"])
    spec = RunSpec.from_config(cfg)
    p = spec.policy()
    assert p.label == "E2-paper" and p.hints.to_train_s == 10.0 and spec.off_policy == "tis"  # one update a step
    assert spec.replace(scheme="A").policy().rollout_cells == 3
    c = P122B.cluster()
    assert cfg.sched.train_tokens_per_s == pytest.approx(c.train_tokens_per_s, rel=1e-3)


def test_sync_lag_and_both_rules_under_bursts():
    from gyre.sched.admission import count_budget, sync_lag, window_budget

    # b = 2: versions 0,1 are sync 0; 2,3 sync 1 (base 0); resumed at 1: 1,2 sync 0
    assert sync_lag(1, 0, 2) == 0 and sync_lag(2, 1, 2) == 1 and sync_lag(2, 1, 2, base=1) == 0
    assert admissible(1, 0, 0, steps_per_sync=2) and expired(2, 0, 0, steps_per_sync=2)
    assert not expired(9, 0, 0, rule="count") and admissible(9, 0, 0, rule="count")
    assert not admissible(0, 1, 3, rule="count")  # not even the count rule trains the future
    assert window_budget(4, 1, 5) == 3  # b = 1, fresh weights: Q(k+1) - open
    assert window_budget(2, 0, 2, steps_per_sync=2, rollout_sync=0, step=1) == 0  # mid-round: wait
    assert window_budget(2, 0, 0, steps_per_sync=2, rollout_sync=1, step=2) == 4  # a new round
    assert count_budget(4, 1, 2, 13) == 3  # (2 + 1 + 1) x 4 - 13


def test_start_budget_uses_the_cores_answer_when_given():
    from dataclasses import replace

    st = state([R, R, T, T], running=0, k=1, open_=0)
    assert start_budget(st) == 8
    assert start_budget(replace(st, starts_allowed=3)) == 3
    assert start_budget(replace(st, starts_allowed=3, starts_blocked=True)) == 0
    for scheme in ("E", "A", "C"):  # no shipped policy starts more than the rule allows
        d = make_policy(scheme, 1, HINTS, rollout_cells=2).decide(replace(st, starts_allowed=3), 10_000.0)
        assert d.start_groups <= 3


def test_elastic_with_one_cell_is_colocate():
    """One cell cannot serve and train at once: E decides exactly as C, whatever the state."""
    rng = random.Random(3)
    e, c = make_policy("E", 2, HINTS), make_policy("C", 2, HINTS)
    for _ in range(300):
        st = state([rng.choice([R, T, TT, TR])], running=rng.randrange(0, 9), k=2,
                   train_left=rng.choice([0.0, 1e6]), step_groups=rng.choice([0, 2, 4]),
                   open_=rng.randrange(0, 13), calls=rng.randrange(0, 5))
        assert e.decide(st, 1e4) == c.decide(st, 1e4)


def test_elastic_trains_on_spare_cells_only_and_keeps_busy_rollout():
    p = make_policy("E", 0, HINTS)
    rate, switch = HINTS.train_tokens_per_s, HINTS.to_train_s
    # 8 calls need 2 of 8 cells: the 6 spare cells train, as many as the work keeps busy past a switch.
    for cells in (1, 3, 6):
        st = state([R] * 8, running=8, calls=8, train_left=rate * switch * cells - 1, open_=10)
        after = apply(st, p.decide(st, 1e4).switches)
        assert sum(r is TT for r in after) == cells
    # However much work waits, training never takes a cell the calls in flight need.
    for calls, spare in ((32, 0), (24, 2), (16, 4)):
        st = state([R] * 8, running=40, calls=calls, train_left=1e12, open_=10)
        assert sum(r is TT for r in apply(st, p.decide(st, 1e4).switches)) == spare
    # Executions between calls count too: 40 running at 5 a cell need all 8 cells.
    p5 = make_policy("E", 0, Hints(train_tokens_per_s=2200, calls_per_cell=4, execs_per_cell=5))
    st = state([R] * 8, running=40, calls=8, train_left=1e12, open_=10)
    assert p5.decide(st, 1e4).switches == ()
    # Nothing admitted and every rollout cell needed: no cell leaves.
    st = state([R] * 8, running=40, calls=32, open_=10)
    assert p.decide(st, 1e4).switches == ()


def test_elastic_at_staleness_above_0_keeps_training_apace_even_when_rollout_needs_every_cell():
    """At k > 0 executions always run (new groups start while the step trains): training on spare
    cells only left it behind and the running groups went stale (the 122B preset at k = 2, 24 steps:
    21,559 groups dropped, 118.6 h vs Async 90.3 h). There the admitted work also gets the cells it
    keeps busy over the horizon; at k = 0 the running executions keep every cell they need."""
    rate = HINTS.train_tokens_per_s
    for k in (1, 2):
        p = make_policy("E", k, HINTS)
        for cells in (1, 3):
            work = rate * p.horizon_s * cells - 1  # keeps `cells` trainers busy over the horizon
            st = state([R] * 8, running=40, calls=32, train_left=work, open_=10, k=k)
            assert sum(r is TT for r in apply(st, p.decide(st, 1e4).switches)) == cells
    p0 = make_policy("E", 0, HINTS)
    st = state([R] * 8, running=40, calls=32, train_left=rate * p0.horizon_s * 3, open_=10)
    assert p0.decide(st, 1e4).switches == ()


def test_elastic_trainers_stay_until_the_work_is_trained_or_rollout_needs_them():
    p = make_policy("E", 0, HINTS)
    layout = [R, R] + [T] * 6
    # Little work left, rollout has what its 8 calls need: trainers stay.
    st = state(layout, running=20, calls=8, train_left=1.0, open_=5)
    assert p.decide(st, 1e4).switches == ()
    # The calls in flight grow to 24 (6 cells' worth): trainers return, leaving the work's one.
    st = state(layout, running=20, calls=24, train_left=1.0, open_=5)
    after = apply(st, p.decide(st, 1e4).switches)
    assert sum(r is TR for r in after) == 4 and sum(r is T for r in after) == 2
