"""The coordinator core on hand-built event sequences (pure: events in, decisions out, no clock)."""

from __future__ import annotations

import pytest

from gyre.sched import make_policy
from gyre.sched.admission import start_budget
from gyre.sched.core import Coordinator, CoreError, CoreSpec, GroupState
from gyre.sched.state import CellView, Role
from support.replay_head import NOTHING_REDUCED, execution_done, head_for_replay, run_config
from support.lag_oracle import LagStats, lag_of

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
    c = core(steps=4, q=1, k=1)
    g0, g1 = launch(c, 2)                      # both served by v0
    finish(c, g0, 1.0, version=0)
    train_and_end(c, 2.0)                      # v1
    (g2,) = launch(c, 1, 2.0)                  # a group is still to start: no slot kept for g1
    finish(c, g2, 3.0, version=1)
    train_and_end(c, 4.0)                      # v2
    adm = finish(c, g1, 5.0, version=0)        # the slow one: lag 2 > 1
    assert adm.dropped and c.started == 3 and c.spec.groups_needed == 4
    # the old rule (started < steps x Q) would allow one start here and then block for good
    st = c.cluster_state(5.0, (CellView(0, Role.ROLLOUT, 0.0),))
    assert not st.starts_blocked and start_budget(st) == 2
    d = make_policy("E", 1).decide(st, 5.0)
    assert d.start_groups == 2                 # a shipped policy asks for the replacement too
    g3, g4 = launch(c, d.start_groups, 5.0)
    finish(c, g3, 6.0, version=2)
    assert train_and_end(c, 7.0).groups == (c.groups[g3],)
    finish(c, g4, 8.0, version=2)
    res = train_and_end(c, 9.0)
    assert c.done and res.groups == (c.groups[g4],)
    assert [g.state for g in c.groups.values()] == [S.TRAINED, S.DROPPED] + [S.TRAINED] * 3
    assert c.cluster_state(9.0, ()).starts_blocked


def test_once_every_group_has_started_a_step_keeps_a_slot_for_its_straggler():
    """Dropping the straggler now would mean a replacement from nothing at the run's end."""
    c = core(steps=3, q=1, k=1)
    g0, g1 = launch(c, 2)                      # both served by v0: g1 may train in step 1 at the latest
    finish(c, g0, 1.0, version=0)
    train_and_end(c, 2.0)                      # v1
    (g2,) = launch(c, 1, 2.0)                  # the run's last start
    assert finish(c, g2, 3.0, version=1).assigned == ()  # the slot is g1's
    assert c.groups[g2].state is S.WAITING and not c.step_ready()
    assert finish(c, g1, 5.0, version=0).assigned == (c.groups[g1],)
    assert train_and_end(c, 6.0).admission.assigned == (c.groups[g2],)  # g2 trains next
    train_and_end(c, 7.0)
    assert c.done and all(g.state is S.TRAINED for g in c.groups.values()) and c.started == 3


def test_the_straggler_takes_its_kept_slot_before_newer_groups_that_came_first():
    c = core(steps=3, q=2, k=1)               # admits first come, first in (fifo_key)
    a, b, x, y = launch(c, 4)
    finish(c, a, 1.0, version=0)
    finish(c, b, 1.0, version=0)
    train_and_end(c, 2.0)                     # v1: x and y may train in step 1 only
    n1, n2 = launch(c, 2, 2.0)                # the run's last starts
    assert finish(c, n1, 3.0, version=1).assigned == ()   # two slots, both kept
    assert finish(c, x, 4.0, version=0).assigned == (c.groups[x],)
    assert finish(c, n2, 5.0, version=1).assigned == ()   # one slot, kept for y
    adm = finish(c, y, 6.0, version=0)
    assert adm.assigned == (c.groups[y],) and not adm.dropped
    assert train_and_end(c, 7.0).admission.assigned == (c.groups[n1], c.groups[n2])


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
    assert c.groups[late].lag_steps == 2 and lag_of(c).worst_steps == 2


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
    lag = lag_of(c)
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
    lag = lag_of(c)
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


# ---- one trace, two drivers -------------------------------------------------------------------

class RecordingCoordinator(Coordinator):
    """The simulator's core, logging every event it is told (the trace replayed into the head)."""

    def __init__(self, spec, key):
        super().__init__(spec, key)
        self.trace: list[tuple] = []

    def start_groups(self, n, now):
        out = super().start_groups(n, now)
        if out:
            self.trace.append(("start", n, now))
        return out

    def execution_started(self, group, key, now):
        self.trace.append(("exec", group, key))
        return super().execution_started(group, key, now)

    def execution_evaluated(self, key, now, *, version=-1, tokens=0.0, usable=True, reward=None):
        self.trace.append(("evaluated", key, now, version, reward))
        return super().execution_evaluated(key, now, version=version, tokens=tokens, usable=usable, reward=reward)

    def step_ending(self, now):
        self.trace.append(("step_ending", now))
        return super().step_ending(now)

    def step_ended(self, now):
        res = super().step_ended(now)
        self.trace.append(("step_ended", now, res.push_due))
        return res

    def weights_pushed(self, version):
        self.trace.append(("pushed", version))
        return super().weights_pushed(version)


def simulated_trace(cfg, slow_group: int, zero_variance_share: float = 0.0):
    """The simulator of `cfg`'s run (its RunSpec, as the head builds its own) on a scripted workload."""
    from gyre.sched import RunSpec
    from gyre.sim.cost_model import ClusterModel
    from gyre.sim.simulator import Simulator, SimSpec
    from gyre.sim.workload import ExecSpec, GroupSpec, Workload

    g = cfg.harness.group_size

    def group(i: int) -> GroupSpec:  # fixed durations; one group far slower than the others
        d = 40_000.0 if i == slow_group else 1_000.0 + 37.0 * (i % 5)
        # tools only (no tokens to decode): an execution lasts exactly its tool time
        return GroupSpec(f"g{i}", tuple(ExecSpec(d + 11.0 * m, 4, 0.0, 50.0 + m, tool_s=d + 11.0 * m)
                                        for m in range(g)))

    w = Workload(group, g, "scripted", 1_000.0, 0.1)
    cluster = ClusterModel(nodes=2, cell_nodes=1, gpus_per_node=1, min_cell_nodes=1,
                           eval_s=0, push_s=0, opt_s=0, to_train_s=0, to_rollout_s=0)
    sim = Simulator(RunSpec.from_config(cfg), w, cluster,
                    SimSpec(segments=1, tick_s=500.0, zero_variance_share=zero_variance_share))
    sim.core = RecordingCoordinator(sim.core.spec, sim.core.key)
    sim.run()
    return sim.core


def record(eid: str, gid: int, member: int, version: int, reward: float | None = None):
    from gyre.traj.record import ExecutionRecord
    from gyre.traj.tree import Segment, TrajectoryTree

    t = TrajectoryTree()
    t.add_call([Segment("task", [5, 6, 7, member + 8], "user")], "a", [3, 4], [20 + member, 30, 31],
               [-0.5, -1.0, -0.25], agent_role="main", policy_version=version)
    return ExecutionRecord(eid, "task", gid, "done", float(member % 2) if reward is None else reward, "tests", tree=t)


@pytest.mark.parametrize("k,b,order", [(1, 1, "stream"), (0, 2, "stream"), (0, 2, "shuffle"), (2, 1, "stream")])
def test_one_trace_through_the_simulator_and_the_head_gives_the_same_steps(tmp_path, k, b, order):
    """Both drivers are built from one configuration (RunSpec.from_config): a field that reaches
    one driver and not the other (the burst order did not reach the simulator) fails here."""
    steps, q, g = 5, 2, 2
    cfg = run_config(tmp_path, steps, q, g, k, b, burst_order=order)
    sim = simulated_trace(cfg, slow_group=1)
    head = head_for_replay(tmp_path, cfg)
    assert head.core.spec == sim.spec and head.core.key == sim.key
    eid_of = {}
    for ev in sim.trace:
        kind = ev[0]
        if kind == "start":
            started = head.start_groups(ev[1], ev[2])
            assert started  # the head's core allows the same starts
        elif kind == "exec":
            gid, key = ev[1], ev[2]
            eid_of[key] = (gid, len([1 for x in eid_of.values() if x[0] == gid]))
        elif kind == "evaluated":
            gid, m = eid_of[ev[1]]
            eid = f"q{gid}-task-g{m}"
            execution_done(head, eid, record(eid, gid, m, ev[3]), ev[2])
        elif kind == "step_ending":
            while (mb := head.core.next_microbatch()) is not None:  # the trainers' replies
                head.core.microbatch_trained(mb)
            assert head.core.step_ready()
            head.core.step_ending(ev[1])
        elif kind == "step_ended":
            res = head.step_ended(ev[1])
            assert res.push_due == ev[2]
            if not res.push_due or head.core.done:  # (the simulator pushes nothing after the last step)
                head.step_committed(res, NOTHING_REDUCED, 0.0)
        elif kind == "pushed":
            head.step_committed(res, NOTHING_REDUCED, 0.0)
    head.ledger.close()
    assert head.core.done and sim.done
    sim_steps = [[gid for gid in (x.id for x in r.groups)] for r in sim.steps]
    head_steps = [[x.id for x in r.groups] for r in head.core.steps]
    assert head_steps == sim_steps
    dropped = {gid for gid, x in sim.groups.items() if x.state is S.DROPPED}
    assert {gid for gid, x in head.core.groups.items() if x.state is S.DROPPED} == dropped
    if k == 1:
        assert dropped  # the slow group was dropped as stale and replaced in both
    # the head wrote down exactly that: each trained execution once, in its step
    import json
    rows = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    trained = {(r["group"], r["step"]) for r in rows if r["admitted"]}
    assert trained == {(gid, s) for s, gids in enumerate(sim_steps) for gid in gids}
    assert all(not r["admitted"] and r["reason"].startswith("stale") for r in rows if r["group"] in dropped)
    worst = {max((x.lag_syncs for x in c.groups.values() if x.lag_syncs is not None), default=0)
             for c in (head.core, sim)}
    assert len(worst) == 1 and worst.pop() <= k


def test_head_requeues_a_lost_micro_batch_once(tmp_path):
    """An agent keeps reporting the micro-batches its dead trainer lost until the step's reduce;
    the head requeues each once (before, a repeated report requeued a micro-batch that another cell
    had trained again: the step never ended and that gradient would have counted twice)."""
    from gyre.sched.protocol import PrepareReduceReply as Reply

    head = head_for_replay(tmp_path, run_config(tmp_path, steps=1, q=1, g=2))
    head.start_groups(1, 0.0)
    for m in range(2):
        eid = f"q0-task-g{m}"
        execution_done(head, eid, record(eid, 0, m, 0), 1.0)
    core_ = head.core
    c1, c2 = head.cells[0], head.cells[1]
    a = core_.next_microbatch()
    core_.microbatch_trained(a)
    c1.step_mbs.add(a)                              # cell 1 trained a ...
    head.training.requeue(c1, {a, 99} & c1.step_mbs)        # ... then its trainer died (a lost)
    assert core_.step.queue[-1] == a and a not in c1.step_mbs
    while (mb := core_.next_microbatch()) is not None:  # cell 2 trains everything, a included
        core_.microbatch_trained(mb)
        c2.step_mbs.add(mb)
    assert core_.step_ready()
    again = Reply(seq=1, cell=c1.id, ok=True, mb_ids=[], lost=[a])
    held = Reply(seq=2, cell=c2.id, ok=True, mb_ids=sorted(c2.step_mbs), lost=[])
    assert head.training.lost_at_prepare(c1, again) == set() and head.training.lost_at_prepare(c2, held) == set()
    died = Reply(seq=3, cell=c2.id, ok=False, lost=[a, 12345])
    assert head.training.lost_at_prepare(c2, died) == {a}    # only what it held counts
    head.ledger.close()


@pytest.mark.parametrize("scheme", ["C", "E", "E-paper"])
def test_a_full_step_with_no_work_still_gets_a_trainer(scheme):
    """Every execution of the step had equal rewards: zero advantage, no micro-batch. The step
    is ready (only its optimizer step is left) and the policy must bring a trainer for it; a
    policy that waits for training work leaves the pool in rollout and the run hangs."""
    c = core(steps=2, q=1, g=2)
    (g,) = launch(c, 1)
    finish(c, g, 5.0, version=0)
    assert c.step.groups == [g] and not c.step.work and c.step_ready()
    cells = tuple(CellView(i, Role.ROLLOUT, 0.0) for i in range(3))
    st = c.cluster_state(1_000.0, cells)
    assert st.step_ready and st.step_full and st.train_tokens_left == 0
    d = make_policy(scheme, 0).decide(st, 1_000.0)
    to_train = [s.cell for s in d.switches if s.to is Role.TRAIN]
    assert to_train, d
    if scheme != "C":
        assert len(to_train) < len(cells)  # elastic keeps a cell serving
    # once a trainer is there the step ends like any other
    c.step_ending(1_010.0)
    res = c.step_ended(1_010.0)
    assert res.version == 1 and [x.id for x in res.groups] == [g] and not c.cluster_state(1_011.0, cells).step_ready


# ---- zero-variance groups (dynamic sampling) -------------------------------------------------

def score(c: Coordinator, gid: int, rewards, now: float = 1.0, version: int = 0):
    adm = None
    for i, r in enumerate(rewards):
        adm = c.execution_evaluated((gid, i), now, version=version, tokens=10.0, reward=r)
    return adm


def test_zero_variance_group_dropped_and_replaced_within_the_cap():
    c = core(steps=1, q=2, g=2, skip_zero_variance=True, max_replacements_per_step=1)
    a, b = launch(c, 2)
    assert launch(c, 5) == []  # the window is full
    adm = score(c, a, [1.0, 1.0])
    assert [g.id for g in adm.dropped] == [a] and c.groups[a].reason == "zero_variance"
    assert c.groups[a].state is S.DROPPED and c.step.replaced == 1
    (r,) = launch(c, 5)  # exactly one replacement may start
    assert score(c, b, [0.0, 0.0]).dropped == ()  # past the cap: it trains as it is
    assert c.groups[b].state is S.ASSIGNED
    score(c, r, [0.0, 1.0])
    res = train_and_end(c, 2.0)
    assert sorted(g.id for g in res.groups) == sorted([b, r]) and res.replaced == 1
    assert c.done and c.zero_variance_dropped == 1


def test_zero_variance_off_unknown_or_lone_rewards_train():
    c = core(steps=1, q=3, g=2, max_replacements_per_step=5)  # skip_zero_variance off
    a, b, d = launch(c, 3)
    assert score(c, a, [1.0, 1.0]).dropped == ()
    c2 = core(steps=1, q=3, g=2, skip_zero_variance=True, max_replacements_per_step=5)
    a, b, d = launch(c2, 3)
    assert score(c2, a, [1.0, None]).dropped == ()   # one reward unknown: not called equal
    c2.execution_evaluated((b, 0), 1.0, version=0, reward=1.0)
    adm = c2.execution_evaluated((b, 1), 1.0, version=0, reward=1.0, usable=False)
    assert adm.dropped == ()  # one usable execution: nothing to compare it with
    assert score(c2, d, [0.5, 0.5 + 1e-9]).dropped[0].reason == "zero_variance"


def test_zero_variance_cap_is_per_step_and_stale_comes_first():
    c = core(steps=3, q=1, g=2, k=1, skip_zero_variance=True, max_replacements_per_step=1)
    g0, g1 = launch(c, 2)
    assert score(c, g0, [1.0, 1.0]).dropped[0].reason == "zero_variance"
    assert score(c, g1, [1.0, 1.0]).dropped == ()  # the cap of step 0 is spent
    train_and_end(c, 2.0)
    (g2, g3) = launch(c, 5)
    assert score(c, g2, [0.0, 0.0], version=1).dropped[0].reason == "zero_variance"  # step 1's own cap
    # a group both stale and zero-variance is dropped as stale (it could never train anyway)
    c3 = core(steps=4, q=1, g=2, k=1, skip_zero_variance=True, max_replacements_per_step=3)
    h0, h1 = launch(c3, 2)
    score(c3, h0, [0.0, 1.0])
    train_and_end(c3, 2.0)
    (h2, *_) = launch(c3, 5)
    score(c3, h2, [0.0, 1.0], version=1)
    train_and_end(c3, 3.0)
    adm = score(c3, h1, [1.0, 1.0], now=4.0, version=0)  # lag 2 syncs > k = 1
    assert adm.dropped[0].reason.startswith("stale") and c3.step.replaced == 0


def test_zero_variance_replacement_under_the_count_rule_does_not_deadlock():
    c = core(steps=1, q=2, g=2, k=0, rule="count", skip_zero_variance=True, max_replacements_per_step=2)
    a, b = launch(c, 5)
    assert launch(c, 5) == []  # (r + k + 1) x Q = 2 started: the count bound
    score(c, a, [1.0, 1.0])
    (r,) = launch(c, 5)  # the dropped group does not count as started
    score(c, b, [0.0, 1.0])
    score(c, r, [1.0, 0.0])
    assert train_and_end(c, 2.0).replaced == 1 and c.done


def test_zero_variance_same_groups_replaced_in_the_simulator_and_the_head(tmp_path):
    """The simulator's zero-variance groups (a seeded share) replayed through the real head:
    the same groups are dropped with reason zero_variance, the same replacements start, the same
    groups train in each step, and each step row says how many were replaced."""
    import json

    steps, q, g = 4, 2, 2
    cfg = run_config(tmp_path, steps, q, g, max_replacements_per_step=1)
    sim = simulated_trace(cfg, slow_group=-1, zero_variance_share=0.5)
    assert sim.spec.skip_zero_variance and sim.zero_variance_dropped >= 2
    head = head_for_replay(tmp_path, cfg)
    assert head.core.spec == sim.spec
    eid_of = {}
    for ev in sim.trace:
        if ev[0] == "start":
            assert head.start_groups(ev[1], ev[2])
        elif ev[0] == "exec":
            eid_of[ev[2]] = (ev[1], len([1 for x in eid_of.values() if x[0] == ev[1]]))
        elif ev[0] == "evaluated":
            gid, m = eid_of[ev[1]]
            eid = f"q{gid}-task-g{m}"
            execution_done(head, eid, record(eid, gid, m, ev[3], reward=ev[4]), ev[2])
        elif ev[0] == "step_ending":
            while (mb := head.core.next_microbatch()) is not None:
                head.core.microbatch_trained(mb)
            head.core.step_ending(ev[1])
        elif ev[0] == "step_ended":
            res = head.step_ended(ev[1])
            if not res.push_due or head.core.done:
                head.step_committed(res, NOTHING_REDUCED, 0.0)
        elif ev[0] == "pushed":
            head.step_committed(res, NOTHING_REDUCED, 0.0)
    head.ledger.close()
    assert [[x.id for x in r.groups] for r in head.core.steps] == [[x.id for x in r.groups] for r in sim.steps]
    zv = {gid for gid, x in sim.groups.items() if x.reason == "zero_variance"}
    assert {gid for gid, x in head.core.groups.items() if x.reason == "zero_variance"} == zv
    rows = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert {r["group"] for r in rows if r["reason"] == "zero_variance" and not r["admitted"]} == zv
    step_rows = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert sum(r["replaced_zero_variance"] for r in step_rows) == len(zv)
    assert all(r["replaced_zero_variance"] <= 1 and r["groups"] == q for r in step_rows)
    assert all(r["replaced_share"] == r["replaced_zero_variance"] / (q + r["replaced_zero_variance"]) for r in step_rows)
    # groups trained past the cap may be zero-variance: they train (zero advantage), none is lost
    assert head.core.trained == steps * q and head.core.started == steps * q + len(zv)


def _round(order: str, seed: int):
    c = core(steps=2, q=2, g=1, k=0, b=2, burst_order=order, seed=seed)
    gids = launch(c, 4)
    assigned = []
    for i, gid in enumerate(gids):  # they finish in id order: 0 is the shortest
        adm = finish(c, gid, 1.0 + i, version=0)
        assigned.append([g.id for g in adm.assigned])
    first = list(c.step.groups)
    train_and_end(c, 10.0)
    second = list(c.step.groups)
    train_and_end(c, 11.0)
    assert c.done and sorted(first + second) == gids
    return assigned, first, second


def test_burst_order_shuffle_waits_for_the_round_then_deals_at_random():
    assigned, first, second = _round("stream", 0)
    assert first == [0, 1] and second == [2, 3]  # finish order: the first step holds the shortest
    assert assigned[:2] == [[0], [1]]
    firsts = set()
    for seed in range(6):
        assigned, first, second = _round("shuffle", seed)
        assert assigned[:3] == [[], [], []] and sorted(assigned[3]) == sorted(first)  # the round first
        firsts.add(tuple(sorted(first)))
    assert len(firsts) > 1 and firsts != {(0, 1)}
    assert _round("shuffle", 3)[1] == _round("shuffle", 3)[1]  # seeded
    with pytest.raises(ValueError, match="burst_order"):
        CoreSpec(steps=1, groups_per_step=1, group_size=1, burst_order="random")


@pytest.mark.parametrize("prox", [True, False])
def test_minibatches_split_a_full_step_and_each_update_trains_its_part(prox):
    from gyre.minibatch import minibatch_parts
    from gyre.sched.core import ProxJob

    assert minibatch_parts(range(5), 2) == [[0, 1], [2, 3, 4]] and minibatch_parts([7], 4) == [[7]]
    c = core(steps=1, q=2, minibatches=2, prox=prox)
    first, second = launch(c, 2)
    finish(c, first, 1.0, 0)
    c.microbatches_added(first, {"a": 1.0, "b": 1.0})
    assert c.next_microbatch() is None and not c.step_ready()  # not full: nothing splits or trains yet
    finish(c, second, 2.0, 0)
    c.microbatches_added(second, {"c": 1.0, "d": 2.0})
    jobs = []
    while (mb := c.next_microbatch()) is not None:
        jobs.append(mb)
        c.microbatch_trained(mb)
    assert jobs == ["a", "b"] + ([ProxJob("c"), ProxJob("d")] if prox else [])
    assert c.step_ready() and not c.step.final
    c.step_ending(3.0)
    c.update_applied()
    with pytest.raises(CoreError):  # once per update
        c.update_applied()
    assert c.step.update == 1 and c.step.final and not c.step_ready()
    c.microbatches_lost(["a"])  # an applied update's gradients: never trained again
    assert c.step.queue == ["c", "d"]
    c.microbatch_trained(c.next_microbatch())
    c.microbatches_lost(["c"])  # lost in the open update: queued again
    assert c.step.queue == ["d", "c"] and not c.step_ready()
    while (mb := c.next_microbatch()) is not None:
        c.microbatch_trained(mb)
    c.step_ending(4.0)
    res = c.step_ended(4.0)
    assert res.version == 1 and sorted(res.microbatches) == ["a", "b", "c", "d"]
