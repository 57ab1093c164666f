"""Simulator: conservation, accounting of every execution, the policies' guarantees end to end,
staleness, the lower bound, and determinism."""

from __future__ import annotations

import pytest

from gyre.events import BUCKETS, RunStats, bucket_seconds
from gyre.sched import Role
from gyre.sim.simulator import SimSpec, Simulator, simulate
from gyre.sim.scenario import Scenario, hints_for, nl2repo_cluster
from gyre.sim.workload import Workload

CASES = [("E", 0), ("E", 1), ("E", 2), ("E-paper", 0), ("E-paper", 2), ("A", 0), ("A", 2), ("C", 0), ("C", 2)]
STEPS, Q = 6, 4


def small(scheme: str, k: int, seed: int = 0, **cluster):
    c = nl2repo_cluster(nodes=16, cell_nodes=4, **cluster)
    return Scenario(scheme, k, c, steps=STEPS, groups_per_step=Q, seed=seed).run()


@pytest.fixture(scope="module")
def runs():
    return {(s, k): small(s, k) for s, k in CASES}


@pytest.mark.parametrize("case", CASES)
def test_conservation_of_gpu_time(runs, case):
    """Per cell and in total: roles + switching + idle = makespan (budget x makespan overall)."""
    r = runs[case]
    for c in r.cell_stats:
        assert sum(bucket_seconds(c).values()) == pytest.approx(r.makespan_s, rel=1e-9)
        assert c["wall_s"] == r.makespan_s and c["failed_s"] == 0.0
    total = sum(sum(bucket_seconds(c).values()) for c in r.cell_stats)
    assert total * r.gpus_per_cell == pytest.approx(r.cells * r.gpus_per_cell * r.makespan_s, rel=1e-9)
    # The Gantt timeline covers the same span with no gaps or overlaps.
    for spans in r.roles:
        assert spans[0][0] == 0.0 and spans[-1][1] == pytest.approx(r.makespan_s)
        assert all(a[1] == pytest.approx(b[0]) for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize("case", CASES)
def test_every_execution_trained_once_or_reported(runs, case):
    r = runs[case]
    assert len(r.outcomes) == r.executions_started
    trained = [o for o in r.outcomes.values() if o[0] == "trained"]
    assert len(trained) == r.executions_trained == STEPS * Q * r.group_size
    assert sum(r.not_admitted.values()) == r.executions_started - r.executions_trained
    assert set(r.not_admitted) <= {"stale", "run_ended"}
    per_step = {}
    for o in trained:
        per_step[o[1]] = per_step.get(o[1], 0) + 1
    assert per_step == {s: Q * r.group_size for s in range(STEPS)}
    assert [s["groups"] for s in r.step_stats] == [Q] * STEPS


@pytest.mark.parametrize("case", CASES)
def test_no_policy_breaks_staleness(runs, case):
    r = runs[case]
    k = case[1]
    for s in r.step_stats:
        assert 0 <= s["staleness_max"] <= k
        assert 0 <= s["staleness_mean"] <= s["staleness_max"]
        assert 0 <= s["staleness_token_mean"] <= s["staleness_max"]


@pytest.mark.parametrize("case", CASES)
def test_makespan_respects_lower_bound(runs, case):
    r = runs[case]
    assert r.lower_bound_s > 0
    assert r.makespan_s >= r.lower_bound_s * (1 - 1e-9)


@pytest.mark.parametrize("case", [c for c in CASES if c[0].startswith("E")])
def test_elastic_never_leaves_running_executions_unserved(runs, case):
    assert runs[case].unserved_s == 0.0


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "A"])
def test_async_never_switches(runs, case):
    r = runs[case]
    assert all(c["switches"] == 0 for c in r.cell_stats)
    assert all(len(spans) == 1 for spans in r.roles)
    # Only weight pushes: one per rollout round but the last, pausing the rollout half of the cells.
    c = nl2repo_cluster(nodes=16, cell_nodes=4)
    assert r.bucket_total("switch") == pytest.approx((r.steps - 1) * r.cells // 2 * c.push_s)


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "C"])
def test_colocate_never_splits(runs, case):
    """At every instant all cells are in, or on their way to, the same role."""
    r = runs[case]
    cuts = sorted({t for spans in r.roles for t0, t1, _ in spans for t in (t0, t1)})
    for a, b in zip(cuts, cuts[1:]):
        mid = (a + b) / 2
        heading = set()
        for spans in r.roles:
            role = next(name for t0, t1, name in spans if t0 <= mid < t1)
            heading.add(Role(role).heading)
        assert len(heading) == 1, (mid, heading)
    # At most one training phase per step (a phase may train two batches back to back).
    assert 1 <= r.cell_stats[0]["switches_to_train"] <= r.steps


def test_switch_counts_match_timeline(runs):
    r = runs[("E", 0)]
    for c, spans in zip(r.cell_stats, r.roles):
        assert c["switches_to_train"] == sum(1 for *_, n in spans if n == "to_train")
        assert c["switches_to_rollout"] == sum(1 for *_, n in spans if n == "to_rollout")
        assert c["switches"] == c["switches_to_train"] + c["switches_to_rollout"]


def test_deterministic_under_a_seed():
    a, b = small("E", 1, seed=7), small("E", 1, seed=7)
    da, db = a.to_dict(), b.to_dict()
    da.pop("wall_s"), db.pop("wall_s")
    assert da == db and a.roles == b.roles and a.outcomes == b.outcomes
    c = small("E", 1, seed=8).to_dict()
    assert c["makespan_s"] != da["makespan_s"]


def test_same_policy_object_drives_the_simulator():
    """The simulator calls the policy's own decide (invariant 3): count the calls."""
    w = Workload.named("nl2repo", 0)
    c = nl2repo_cluster(nodes=8, cell_nodes=4)
    sc = Scenario("E", 0, c, steps=2, groups_per_step=2)
    sim = Simulator(sc.spec(w), w, c, SimSpec())
    p, calls = sim.p, []
    orig = p.decide
    p.decide = lambda st, now: (calls.append(now), orig(st, now))[1]
    r = sim.run()
    assert len(calls) == r.decisions > 10 and calls == sorted(calls)


@pytest.mark.parametrize("k", [1, 2])  # k=1 starts a single group once
def test_async_starting_the_cores_budget_is_asking_its_decide(monkeypatch, k):
    """Async declares starts_budget_only, so the simulator starts the core's budget without
    building a state; the run must equal one where its decide is asked every time."""
    from gyre.sched import AsyncPolicy
    fast = small("A", k).to_dict()
    monkeypatch.setattr(AsyncPolicy, "starts_budget_only", False)
    slow = small("A", k).to_dict()
    fast.pop("wall_s"), slow.pop("wall_s")
    assert fast == slow and fast["decisions"] > 10


def test_more_staleness_is_not_slower_for_elastic(runs):
    assert runs[("E", 2)].makespan_s <= runs[("E", 0)].makespan_s


def test_hints_follow_the_models():
    w = Workload.named("nl2repo", 0)
    c4, c8 = nl2repo_cluster(cell_nodes=4), nl2repo_cluster(cell_nodes=8)
    h4, h8 = hints_for(c4, w), hints_for(c8, w)
    assert h8.to_train_s == c8.to_train_s and h8.train_tokens_per_s == c8.train_tokens_per_s
    # a cell of twice the nodes holds twice the replicas: twice the calls at the same speed
    assert h8.calls_per_cell == pytest.approx(2 * h4.calls_per_cell)
    assert h8.train_tokens_per_s == pytest.approx(2 * h4.train_tokens_per_s)


def test_idle_spans_match_idle_time(runs):
    for r in runs.values():
        for c, spans in zip(r.cell_stats, r.idle):
            assert sum(b - a for a, b in spans) == pytest.approx(c["idle_s"], abs=1e-6)


def test_the_simulator_tells_the_live_heads_events_and_reports_in_their_schema():
    """Replaying what the simulator told gives its result: step rows, lag and cell time are
    RunStats's (one report schema for live and simulated runs)."""
    w = Workload.named("nl2repo", 0)
    c = nl2repo_cluster(nodes=16, cell_nodes=4)
    told = []
    r = simulate(Scenario("E", 1, c, steps=3, groups_per_step=4).spec(w), w, c, on_event=told.append)
    again = RunStats().extend(told)
    assert again.steps == r.step_stats and [again.cell_time(i) for i in again.cell_ids()] == r.cell_stats
    assert r.lag == {"groups": 12, **{k: v for k, v in r.lag.items() if k != "groups"}}
    assert sum(r.not_admitted.values()) == again.dropped_executions == r.executions_started - r.executions_trained
    kinds = {type(e).__name__ for e in told}
    assert {"RunStarted", "CellRoleChanged", "ExecutionStarted", "ExecutionEvaluated", "CellBusy",
            "StepEnded", "RunEnded"} <= kinds
    # the report reads cell time in gyre.events.BUCKETS: every simulated cell fills exactly those
    assert all(set(bucket_seconds(c)) == set(BUCKETS) for c in r.cell_stats)


def test_a_policy_overriding_decide_is_not_taken_as_starting_the_budget_only():
    """starts_budget_only lets the simulator skip `decide`: a subclass with its own `decide` must
    not inherit it unless it declares it again."""
    from gyre.sched import AsyncPolicy
    from gyre.sched.state import Decision

    class Switching(AsyncPolicy):
        def decide(self, state, now):
            return Decision()

    class Declared(AsyncPolicy):
        starts_budget_only = True

        def decide(self, state, now):
            return super().decide(state, now)

    assert AsyncPolicy.starts_budget_only and Declared.starts_budget_only
    assert not Switching.starts_budget_only
