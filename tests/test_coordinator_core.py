"""The coordinator core on hand-built event sequences (pure: events in, decisions out, no clock)."""

from __future__ import annotations

import pytest

from gyre.sched import make_policy
from gyre.sched.admission import start_budget
from gyre.sched.core import Coordinator, CoreError, CoreSpec, GroupState, LagStats
from gyre.sched.state import CellView, Role

S = GroupState


def core(steps=3, q=1, g=1, k=0, rule="window", b=1, **kw) -> Coordinator:
    return Coordinator(CoreSpec(steps=steps, groups_per_step=q, group_size=g, staleness=k,
                                staleness_rule=rule, steps_per_sync=b, **kw))


def launch(c: Coordinator, n: int, now: float = 0.0) -> list[int]:
    """Start up to n groups and all of their executions; returns the group ids."""
    out = []
    for grp in c.start_groups(n, now):
        for i in range(c.spec.group_size):
            c.execution_started(grp.id, (grp.id, i), now)
        out.append(grp.id)
    return out


def finish(c: Coordinator, gid: int, now: float, version: int, tokens: float = 10.0):
    """All executions of a group end and are scored; returns the last Admission."""
    adm = None
    for i in range(c.spec.group_size):
        adm = c.execution_evaluated((gid, i), now, version=version, tokens=tokens)
    return adm


def train_and_end(c: Coordinator, now: float):
    """Add one micro-batch per assigned group, train them all, end the step."""
    for gid in c.step.groups:
        if not any(m[0] == gid for m in c.step.work):
            c.microbatches_added(gid, {(gid, "mb"): c.groups[gid].train_tokens})
    while (mb := c.next_microbatch()) is not None:
        c.microbatch_trained(mb)
    assert c.step_ready()
    c.step_ending(now)
    res = c.step_ended(now)
    if res.push_due:
        c.weights_pushed(res.version)
    return res


def test_states_follow_the_lifecycle():
    c = core(steps=1, q=1, g=2)
    (gid,) = [g.id for g in c.start_groups(1, 0.0)]
    assert c.groups[gid].state is S.STARTED
    c.execution_started(gid, "a", 0.0)
    c.execution_started(gid, "b", 0.0)
    assert c.groups[gid].state is S.RUNNING
    with pytest.raises(CoreError):
        c.execution_started(gid, "c", 0.0)  # a group holds G executions
    c.execution_ended("a", 1.0)
    assert [e.group for e in c.cluster_state(1.0, ()).running] == [gid]  # only b still runs
    adm = c.execution_evaluated("a", 2.0, version=0, tokens=3)
    assert adm.assigned == () and adm.dropped == ()
    assert c.groups[gid].state is S.RUNNING  # waits for its last execution
    adm = c.execution_evaluated("b", 3.0, version=0, tokens=4)
    g = c.groups[gid]
    assert adm.assigned == (g,) and g.state is S.ASSIGNED and g.train_tokens == 7 and g.ready_at == 3.0
    with pytest.raises(CoreError):
        c.execution_evaluated("b", 3.0, version=0)
    res = train_and_end(c, 4.0)
    assert g.state is S.TRAINED and res.groups == (g,) and g.lag_steps == 0 and c.done
    assert c.start_groups(5, 5.0) == []  # the run is done: nothing starts


def test_group_version_is_the_oldest_serving_one_and_made_no_call_falls_back():
    c = core(steps=2, q=1, g=3, k=2)
    (gid,) = launch(c, 1)
    c.execution_evaluated((gid, 0), 1.0, version=1)
    c.execution_evaluated((gid, 1), 1.0, version=-1)  # made no model call
    c.execution_evaluated((gid, 2), 1.0, version=0)
    assert c.groups[gid].version == 0


def test_window_rule_drops_a_stale_group_at_evaluation_and_at_step_end():
    c = core(steps=4, q=1, k=1)
    a, b, = launch(c, 5)                      # budget Q*(k+1) = 2
    assert c.start_budget() == 0
    finish(c, a, 1.0, version=0)
    train_and_end(c, 2.0)                      # step 0 -> version 1
    (n,) = launch(c, 5, 2.0)
    finish(c, n, 3.0, version=1)
    train_and_end(c, 4.0)                      # step 1 -> version 2
    adm = finish(c, b, 5.0, version=0)         # lag 2 > 1: dropped when it is scored
    assert adm.dropped == (c.groups[b],) and c.groups[b].state is S.DROPPED
    assert "stale" in c.groups[b].reason and "v0" in c.groups[b].reason
    # a group that waits while the version moves past its bound expires at the step end
    c2 = core(steps=4, q=1, k=0)
    x, = launch(c2, 1)
    finish(c2, x, 1.0, version=0)
    y, = launch(c2, 1, 1.0) if c2.start_budget() else (None,)
    assert y is None  # k = 0: one group open at a time
    train_and_end(c2, 2.0)
    y, = launch(c2, 1, 2.0)
    z_adm = finish(c2, y, 3.0, version=0)      # served by v0 but scored at step 1 (k = 0)
    assert z_adm.dropped and c2.groups[y].state is S.DROPPED


def test_waiting_group_expires_when_a_step_ends():
    c = core(steps=4, q=1, k=1)
    g0, g1 = launch(c, 2)
    finish(c, g0, 1.0, version=0)
    train_and_end(c, 2.0)                      # v1
    (g2,) = launch(c, 1, 2.0)
    finish(c, g2, 3.0, version=1)              # fills step 1
    finish(c, g1, 3.5, version=0)              # lag 1 is admissible, but the step is full
    assert c.groups[g1].state is S.WAITING
    assert c.cluster_state(3.5, ()).groups_waiting == 1
    res = train_and_end(c, 4.0)                # v2: g1 would lag 2 > 1
    assert res.admission.dropped == (c.groups[g1],) and c.groups[g1].state is S.DROPPED
    assert c.cluster_state(4.0, ()).groups_waiting == 0


def test_hung_sequence_is_replaced_and_the_last_step_fills():
    """The live hang: at staleness 1 a group dropped as stale was never replaced (the head
    blocked starts once steps x Q groups had *started*), so the last step never filled."""
    c = core(steps=3, q=1, k=1)
    g0, g1 = launch(c, 2)                      # both served by v0
    finish(c, g0, 1.0, version=0)
    train_and_end(c, 2.0)                      # v1
    (g2,) = launch(c, 1, 2.0)
    finish(c, g2, 3.0, version=1)
    train_and_end(c, 4.0)                      # v2
    adm = finish(c, g1, 5.0, version=0)        # the slow one: lag 2 > 1
    assert adm.dropped and c.started == 3 and c.spec.groups_needed == 3
    # the old rule (started >= steps x Q) would block here for good
    st = c.cluster_state(5.0, (CellView(0, Role.ROLLOUT, 0.0),))
    assert not st.starts_blocked and start_budget(st) == 1
    d = make_policy("E", 1).decide(st, 5.0)
    assert d.start_groups == 1                 # a shipped policy asks for the replacement
    (g3,) = launch(c, d.start_groups, 5.0)
    finish(c, g3, 6.0, version=2)
    res = train_and_end(c, 7.0)
    assert c.done and res.groups == (c.groups[g3],)
    assert [g.state for g in c.groups.values()] == [S.TRAINED, S.DROPPED, S.TRAINED, S.TRAINED]
    assert c.cluster_state(7.0, ()).starts_blocked


def end_step(c: Coordinator, now: float):
    for gid in c.step.groups:
        c.microbatches_added(gid, {gid: 1.0})
    while (mb := c.next_microbatch()) is not None:
        c.microbatch_trained(mb)
    c.step_ending(now)
    return c.step_ended(now)


def test_count_rule_bounds_starts_by_rollout_version_and_drops_nothing():
    c = core(steps=6, q=2, k=1, rule="count")
    assert c.start_budget() == 4               # (0 + 1 + 1) x 2
    g0, g1, g2, late = launch(c, 10)
    assert c.start_budget() == 0
    finish(c, g0, 1.0, version=0)
    finish(c, g1, 1.0, version=0)
    res = end_step(c, 2.0)
    assert res.push_due and c.start_budget() == 0  # the bound moves with the rollout version ...
    c.weights_pushed(res.version)
    assert c.start_budget() == 2               # ... (1 + 1 + 1) x 2 - 4 started
    finish(c, g2, 3.0, version=0)              # lag 1
    g4, g5 = launch(c, 5, 3.0)
    finish(c, g4, 3.5, version=1)
    c.weights_pushed(end_step(c, 4.0).version)
    assert c.start_budget() == 2               # (2 + 1 + 1) x 2 - 6
    finish(c, g5, 5.0, version=1)
    adm = finish(c, late, 6.0, version=0)      # lag 2 > k: the count rule drops nothing
    assert adm.assigned == (c.groups[late],) and not adm.dropped
    end_step(c, 7.0)
    assert c.groups[late].lag_steps == 2 and c.lag_stats().worst_steps == 2


def test_burst_pushes_once_per_round_and_records_both_lags():
    c = core(steps=4, q=1, k=0, b=2)
    assert c.start_budget() == 2               # one round feeds 2 steps
    a, b = launch(c, 2)
    finish(c, a, 1.0, version=0)
    finish(c, b, 1.0, version=0)
    r0 = train_and_end(c, 2.0)
    assert not r0.push_due and c.rollout_version == 0 and c.version == 1
    assert c.groups[b].state is S.ASSIGNED     # same round: lag 1 step, 0 syncs, admitted at k = 0
    assert c.start_budget() == 0               # the next round waits for the next weights
    r1 = train_and_end(c, 3.0)
    assert r1.push_due and c.rollout_version == 2
    ga, gb = c.groups[a], c.groups[b]
    assert (ga.lag_steps, ga.lag_syncs) == (0, 0) and (gb.lag_steps, gb.lag_syncs) == (1, 0)
    assert ga.sync == gb.sync == 0
    assert c.start_budget() == 2
    lag = c.lag_stats()
    assert lag.worst_steps == 1 and lag.worst_syncs == 0 and lag.group_mean_steps == 0.5


def test_lag_stats_weigh_groups_and_tokens():
    c = core(steps=3, q=2, k=2)
    gs = launch(c, 6)
    finish(c, gs[0], 1.0, version=0, tokens=10)
    finish(c, gs[1], 1.0, version=0, tokens=10)
    train_and_end(c, 2.0)
    finish(c, gs[2], 3.0, version=0, tokens=30)    # lag 1, heavy
    finish(c, gs[3], 3.0, version=1, tokens=10)    # lag 0
    train_and_end(c, 4.0)
    lag = c.lag_stats()
    assert lag.groups == 4 and lag.worst_steps == 1
    assert lag.group_mean_steps == pytest.approx(1 / 4)
    assert lag.token_mean_steps == pytest.approx(30 / 60)
    assert lag.group_mean_syncs == lag.group_mean_steps  # b = 1: both units agree
    assert LagStats.of([]).groups == 0


def test_microbatches_stream_and_lost_ones_are_requeued():
    c = core(steps=2, q=1, k=0)
    (g,) = launch(c, 1)
    finish(c, g, 1.0, version=0)
    c.microbatches_added(g, {1: 100.0, 2: 50.0})
    with pytest.raises(CoreError):
        c.microbatches_added(g, {1: 100.0})
    st = c.cluster_state(1.0, ())
    assert st.train_tokens_left == 150 and st.step_groups == 1 and st.step_full
    m1, m2 = c.next_microbatch(), c.next_microbatch()
    assert (m1, m2) == (1, 2) and c.next_microbatch() is None
    c.microbatch_trained(1)
    c.microbatches_lost([2])                   # its trainer died
    assert not c.step_ready() and c.step.queue == [2]
    assert c.cluster_state(1.0, ()).train_tokens_done == 100
    c.microbatch_trained(c.next_microbatch())
    assert c.step_ready()
    c.step_ending(2.0)
    st = c.cluster_state(2.0, ())
    assert st.train_tokens_left >= 1.0         # the optimizer step is still work for the trainers
    assert c.next_microbatch() is None
    c.step_aborted()                           # e.g. a gradient was lost at prepare_reduce
    assert c.step_ready()


def test_training_progress_is_exact_when_all_work_is_done():
    """No float residue: a policy deciding on `train_tokens_left <= 0` sees exactly 0 (the
    simulator and the head must not diverge on summation order)."""
    c = core(steps=1, q=1, k=0)
    (g,) = launch(c, 1)
    finish(c, g, 1.0, version=0)
    work = {i: t for i, t in enumerate([0.1, 0.2, 0.3, 1e-9, 7.7])}
    c.microbatches_added(g, work)
    for _ in work:
        c.microbatch_trained(c.next_microbatch())
    st = c.cluster_state(2.0, ())
    assert st.train_tokens_left == 0.0 and st.train_tokens_done == sum(work.values())
    c.microbatches_lost([4])
    assert c.step.tokens_left == pytest.approx(7.7)


def test_cluster_state_counts_and_resume_ids():
    c = core(steps=5, q=2, g=2, k=1, start_version=3, first_group=40)
    assert c.spec.groups_needed == 4 and c.start_budget() == 4
    gs = launch(c, 3, 10.0)
    assert gs == [40, 41, 42]
    finish(c, 40, 11.0, version=3)
    cells = (CellView(0, Role.ROLLOUT, 0.0), CellView(1, Role.TRAIN, 5.0))
    st = c.cluster_state(12.0, cells)
    assert st.cells == cells and st.version == 3 and st.groups_open == 3 and st.step_groups == 1
    assert len(st.running) == 4 and {e.group for e in st.running} == {41, 42}
    assert st.starts_allowed == 1 and not st.starts_blocked  # needed 4 - 3 open
    assert st.steps_per_sync == 1 and st.staleness_rule == "window"


def test_bad_spec_is_refused():
    with pytest.raises(ValueError, match="staleness_rule"):
        CoreSpec(steps=1, groups_per_step=1, group_size=1, staleness_rule="hard")
    with pytest.raises(ValueError, match="steps_per_sync"):
        CoreSpec(steps=1, groups_per_step=1, group_size=1, steps_per_sync=0)
