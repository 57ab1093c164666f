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
- arrival (window rule, one step per sync): step s trains only groups started under version
  s - k or later, and version v exists only once step v - 1 has ended (its optimizer step
  included). A group cannot be ready before its slowest execution has run alone on a replica
  (batch 1) and been evaluated, and by x after its start the cells cannot have decoded more than
  cells * saturated rate * x. So for any x, the training tokens of step s's groups that cannot be
  ready by x are trained after x on at most every cell:
      end(s) >= end(s - k - 1) [+ the weight push at k = 0] + x + those tokens / (all cells'
                training rate) + optimizer step,
  taking the best x (groups ready by x are credited greedily, which only makes the bound lower);
  and steps train one after another: end(s) >= end(s - 1) + step s's tokens / (all cells' rate)
  + optimizer step. Each step is given the whole cluster (other steps' decoding overlapping it is
  ignored), so this is what a perfect scheduler could do with the same groups and staleness. With
  bursts or the counting rule a policy may reorder which groups train when, so it is not used.
- concurrency (window rule): at most b x Q x (k + 1) groups are open at once, and each stays open
  at least as long as its slowest execution alone on a cell plus evaluation.
"""

from __future__ import annotations

import bisect

from gyre.sim.cost_model import ClusterModel
from gyre.sim.workload import ExecSpec, GroupSpec, Workload


def _solo_s(e: ExecSpec, c: ClusterModel) -> float:
    """An execution alone: its tools, its prefills (with no attention) and its decode at batch 1 with
    no KV read (a floor: the fluid decode pool shares one mean context across the calls in flight,
    so a long-context call may decode faster than its own context would allow)."""
    return e.tool_s + c.replica.prefill_floor_s(e.prefill_tokens) + e.output_tokens * c.replica.step_s(1, 0.0)


def _decode_cell_s(e: ExecSpec, c: ClusterModel) -> float:
    """Cell-seconds its decode needs at least: every token reads its call's KV and state once and
    pays the engine's per-call time (the weights are shared by an unbounded batch and cost nothing
    per token in the limit)."""
    return e.output_tokens * c.replica.marginal_call_s(e.context_tokens / 2) / c.replicas


def lower_bound_trained(w: Workload, c: ClusterModel, trained_by_step: list[list[int]], arrival: bool,
                        max_open: int = 0, staleness: int = 0) -> float:
    """Bound on the groups trained, step by step (workload group ids); `arrival` under the window
    rule with one step per sync, where step s trains groups of versions >= s - `staleness`.

    `max_open` (window rule: b x Q x (k + 1)) adds the concurrency limit: a group is open from its
    start until it trains, at least as long as its slowest execution alone plus its evaluation,
    and at most max_open groups are open at once, so the makespan is at least the sum of those
    times over the trained groups / max_open."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    roll = train = busy = 0.0
    end: list[float] = []  # earliest end of each step (optimizer step included)
    full = c.train_rate(c.cells)
    push = c.push_s if staleness == 0 else 0.0  # at k > 0 a group may start during the push
    for s, ids in enumerate(trained_by_step):
        batch = [w.group(i) for i in ids]
        tokens = 0.0
        for g in batch:
            for e in g.execs:
                roll += _decode_cell_s(e, c)
                train += e.train_tokens / c.train_rate(1)
                tokens += e.train_tokens
            busy += max(_solo_s(e, c) for e in g.execs) + c.eval_s
        if arrival:
            opened = end[s - staleness - 1] + push if s > staleness else 0.0
            after_prev = end[-1] + tokens / full if end else tokens / full
            end.append(max(opened + (_step_arrival_bound(batch, c) if batch else 0.0), after_prev) + c.opt_s)
    work = (roll + train) / c.cells
    conc = busy / max_open if max_open > 0 else 0.0
    return max(work, end[-1] if end else 0.0, conc)


def lower_bound(w: Workload, c: ClusterModel, steps: int, groups_per_step: int, staleness: int) -> float:
    """The bound on the workload's first steps x Q groups (a plan before any run)."""
    ids = [list(range(s * groups_per_step, (s + 1) * groups_per_step)) for s in range(steps)]
    return lower_bound_trained(w, c, ids, arrival=True, staleness=staleness)


def _step_arrival_bound(batch: list[GroupSpec], c: ClusterModel) -> float:
    rows = []  # (earliest ready time, decode cell-seconds, training tokens)
    for g in batch:
        ready = max(_solo_s(e, c) for e in g.execs) + c.eval_s
        rows.append((ready, sum(_decode_cell_s(e, c) for e in g.execs), sum(e.train_tokens for e in g.execs)))
    rows.sort()
    total = sum(r[2] for r in rows)
    full = c.train_rate(c.cells)
    best = total / full  # x = 0: nothing is ready, everything trains afterwards
    # The groups that could be ready by x, most tokens per decode work first (ties in ready order):
    # kept sorted as x grows instead of sorted again for every x (the same order, the same sums).
    eligible: list[tuple] = []  # (-tokens per work, row index, work, tokens)
    j = 0
    for x, _, _ in rows:
        while j < len(rows) and rows[j][0] <= x:
            _, work, tokens = rows[j]
            bisect.insort(eligible, (-tokens / max(work, 1e-12), j, work, tokens))
            j += 1
        capacity = c.cells * (x - c.eval_s)  # decode cell-seconds possible before x
        done = 0.0
        # Fractional knapsack over the groups that could be ready.
        for _, _, work, tokens in eligible:
            if capacity <= 0:
                break
            take = min(1.0, capacity / work) if work > 0 else 1.0
            done += tokens * take
            capacity -= work * take
        best = max(best, x + (total - done) / full)
    return best
