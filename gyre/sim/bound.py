"""A lower bound on end-to-end time for a workload on a cluster, whatever the policy.

Computed on the groups a run actually trained (``lower_bound_trained``): a run that drops stale
groups (longer than average) and trains shorter replacements is measured against the work it
trained, not against the first groups of the workload, so its "x bound" is not flattered. Any
policy that trains those groups in those steps must do that work.

Two limits, the larger wins:
- work: every cell busy all the time, decoding at the saturated rate of a cell (batch -> infinity:
  each decoded token reads its call's KV once, the weights cost nothing per token) and training
  at full rate, with no switches: (rollout cell-time + training cell-time) / cells.
  Optimizer steps and weight pushes occupy only one side of the cluster, so they are not added.
- arrival (staleness 0 only): step s trains exactly the groups started under version s. A group
  cannot be ready before its slowest execution has run alone on a replica (batch 1) and been
  evaluated, and by time x the cells cannot have decoded more than cells * saturated rate * x.
  So for any x, the training tokens of groups that cannot be ready by x are trained after x on
  at most every cell: step >= x + those tokens / (all cells' training rate) + optimizer step, and
  the next step's decoding waits for the weight push. The bound
  takes the best x for every step (groups ready by x are credited greedily, which only makes the
  bound lower). Under k > 0 or with bursts a policy may reorder which groups train when.
- concurrency (window rule): at most b x Q x (k + 1) groups are open at once, and each stays open
  at least as long as its slowest execution alone on a cell plus evaluation.
"""

from __future__ import annotations

from gyre.sim.cost_model import ClusterModel
from gyre.sim.workload import ExecSpec, GroupSpec, Workload


def _solo_s(e: ExecSpec, c: ClusterModel) -> float:
    """An execution alone: its tools, its prefills (with no attention) and its decode at batch 1 with
    no KV read (a floor: the fluid decode pool shares one mean context across the calls in flight,
    so a long-context call may decode faster than its own context would allow)."""
    return e.tool_s + c.replica.prefill_floor_s(e.prefill_tokens) + e.output_tokens * c.replica.step_s(1, 0.0)


def _decode_cell_s(e: ExecSpec, c: ClusterModel) -> float:
    """Cell-seconds its decode needs at least: every token reads its call's KV once (the weights
    are shared by an unbounded batch and cost nothing per token in the limit)."""
    return e.output_tokens * (e.context_tokens / 2) * c.replica.kv_bytes_per_token / c.replica.bandwidth / c.replicas


def lower_bound_trained(w: Workload, c: ClusterModel, trained_by_step: list[list[int]], arrival: bool,
                        max_open: int = 0) -> float:
    """Bound on the groups trained, step by step (workload group ids); `arrival` at k = 0, b = 1.

    `max_open` (window rule: b x Q x (k + 1)) adds the concurrency limit: a group is open from its
    start until it trains, at least as long as its slowest execution alone plus its evaluation,
    and at most max_open groups are open at once, so the makespan is at least the sum of those
    times over the trained groups / max_open."""
    roll = train = arr = busy = 0.0
    n = len(trained_by_step)
    for s, ids in enumerate(trained_by_step):
        batch = [w.group(i) for i in ids]
        for g in batch:
            for e in g.execs:
                roll += _decode_cell_s(e, c)
                train += e.train_tokens / c.train_rate(1)
            busy += max(_solo_s(e, c) for e in g.execs) + c.eval_s
        if arrival and batch:
            arr += _step_arrival_bound(batch, c) + c.opt_s + (c.push_s if s < n - 1 else 0.0)
    work = (roll + train) / c.cells
    conc = busy / max_open if max_open > 0 else 0.0
    return max(work, arr, conc)


def lower_bound(w: Workload, c: ClusterModel, steps: int, groups_per_step: int, staleness: int) -> float:
    """The bound on the workload's first steps x Q groups (a plan before any run)."""
    ids = [list(range(s * groups_per_step, (s + 1) * groups_per_step)) for s in range(steps)]
    return lower_bound_trained(w, c, ids, arrival=staleness == 0)


def _step_arrival_bound(batch: list[GroupSpec], c: ClusterModel) -> float:
    rows = []  # (earliest ready time, decode cell-seconds, training tokens)
    for g in batch:
        ready = max(_solo_s(e, c) for e in g.execs) + c.eval_s
        rows.append((ready, sum(_decode_cell_s(e, c) for e in g.execs), sum(e.train_tokens for e in g.execs)))
    rows.sort()
    total = sum(r[2] for r in rows)
    full = c.train_rate(c.cells)
    best = total / full  # x = 0: nothing is ready, everything trains afterwards
    for x, _, _ in rows:
        capacity = c.cells * (x - c.eval_s)  # decode cell-seconds possible before x
        done = 0.0
        # Fractional knapsack over the groups that could be ready: most tokens per decode work first.
        eligible = sorted((r for r in rows if r[0] <= x), key=lambda r: -r[2] / max(r[1], 1e-12))
        for _, work, tokens in eligible:
            if capacity <= 0:
                break
            take = min(1.0, capacity / work) if work > 0 else 1.0
            done += tokens * take
            capacity -= work * take
        best = max(best, x + (total - done) / full)
    return best
