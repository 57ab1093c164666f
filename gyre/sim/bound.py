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

import math

from gyre.sim.cost_model import ClusterModel
from gyre.sim.workload import ExecSpec, Workload


def _solo_s(e: ExecSpec, c: ClusterModel, step1_s: float) -> float:
    """An execution alone: its tools, its prefills (with no attention) and its decode at batch 1 with
    no KV read, `step1_s` = c.replica.step_s(1, 0.0) (a floor: the fluid decode pool shares one mean
    context across the calls in flight, so a long-context call may decode faster than its own
    context would allow). The step time is passed in: building the step function per execution
    was a quarter of the bound's time."""
    return e.tool_s + c.replica.prefill_floor_s(e.prefill_tokens) + e.output_tokens * step1_s


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
    one, step1 = c.train_rate(1), c.replica.step_s(1, 0.0)  # (the model is frozen: the same floats)
    for s, ids in enumerate(trained_by_step):
        tokens = 0.0
        rows = []  # per group: (earliest ready time, decode cell-seconds, training tokens)
        for i in ids:
            execs = w.group(i).execs
            decode = [_decode_cell_s(e, c) for e in execs]  # each worked out once, added in order
            for e, d in zip(execs, decode):
                roll += d
                train += e.train_tokens / one
                tokens += e.train_tokens
            ready = max(_solo_s(e, c, step1) for e in execs) + c.eval_s
            busy += ready
            rows.append((ready, sum(decode), sum(e.train_tokens for e in execs)))
        if arrival:
            opened = end[s - staleness - 1] + push if s > staleness else 0.0
            after_prev = end[-1] + tokens / full if end else tokens / full
            end.append(max(opened + (_step_arrival_bound(rows, c.cells, c.eval_s, full) if rows else 0.0),
                           after_prev) + c.opt_s)
    work = (roll + train) / c.cells
    conc = busy / max_open if max_open > 0 else 0.0
    return max(work, end[-1] if end else 0.0, conc)


def lower_bound(w: Workload, c: ClusterModel, steps: int, groups_per_step: int, staleness: int) -> float:
    """The bound on the workload's first steps x Q groups (a plan before any run)."""
    ids = [list(range(s * groups_per_step, (s + 1) * groups_per_step)) for s in range(steps)]
    return lower_bound_trained(w, c, ids, arrival=True, staleness=staleness)


def _step_arrival_bound(rows: list[tuple], cells: int, eval_s: float, full: float) -> float:
    """max over x (each group's ready time) of x + the step's tokens not ready by x / `full`, the
    tokens ready by x being a fractional knapsack (most tokens per decode work first, ties in ready
    order) of the decode cell-seconds possible before x over the groups that could be ready.

    Each x's knapsack is first estimated in O(log n) (Fenwick trees over the knapsack order), with
    a bound on the estimate's rounding error; only the x whose estimate plus that bound could beat
    the best so far get the exact, sequential knapsack (almost always one or two), so the result
    is the float-for-float one of summing every x's knapsack in order (O(n^2) at 256 groups/step)."""
    if not rows:
        return 0.0
    rows = sorted(rows)
    n = len(rows)
    total = sum(r[2] for r in rows)
    ratio = [-tokens / max(work, 1e-12) for _, work, tokens in rows]
    order = sorted(range(n), key=lambda j: (ratio[j], j))  # the knapsack's order
    rank = [0] * n
    for r, j in enumerate(order):
        rank[j] = r
    fw, ft, fc = [0.0] * (n + 1), [0.0] * (n + 1), [0] * (n + 1)  # Fenwick: work, tokens, count by rank
    top = 1 << (n.bit_length() - 1)
    # a bound on |estimate - exact| of done: both sum at most n terms in other orders, and an error
    # in the spare capacity moves done by at most the best ratio times it (generous: 64 n ulp)
    rmax = max(0.0, -min(ratio))
    work_all = sum(r[1] for r in rows)
    tol = 64 * n * 2.0 ** -52
    # a group with no decode work is taken whole while any capacity is left, so a rounding of the
    # capacity can move done by its tokens: with one, every x is summed exactly (none in a run)
    every_x = any(r[1] <= 0 for r in rows)
    est = []  # (upper bound on the exact candidate, x, rows that could be ready by x)
    j, prev = 0, None
    for x, _, _ in rows:
        if x == prev:  # the same groups and capacity: the same candidate
            continue
        prev = x
        while j < n and rows[j][0] <= x:
            _, work, tokens = rows[j]
            k = rank[j] + 1
            while k <= n:
                fw[k] += work
                ft[k] += tokens
                fc[k] += 1
                k += k & -k
            j += 1
        capacity = cells * (x - eval_s)
        done = 0.0
        if capacity > 0:
            pos, w_acc, t_acc, c_acc, step = 0, 0.0, 0.0, 0, top
            while step:  # the longest prefix (in the knapsack's order) that fits whole
                nxt = pos + step
                if nxt <= n and w_acc + fw[nxt] <= capacity:
                    pos, w_acc, t_acc, c_acc = nxt, w_acc + fw[nxt], t_acc + ft[nxt], c_acc + fc[nxt]
                step >>= 1
            done = t_acc
            if c_acc < j:  # the next group that could be ready goes in in part
                q, want, step = 0, c_acc + 1, top
                while step:
                    nxt = q + step
                    if nxt <= n and fc[nxt] < want:
                        q, want = nxt, want - fc[nxt]
                    step >>= 1
                _, work, tokens = rows[order[q]]
                done += tokens * (min(1.0, (capacity - w_acc) / work) if work > 0 else 1.0)
        err = math.inf if every_x else (tol * (total + rmax * (abs(capacity) + work_all)) / full
                                        + tol * (abs(x) + total / full))
        est.append((x + (total - done) / full + err, x, j))
    best = total / full  # x = 0: nothing is ready, everything trains afterwards
    for upper, x, m in sorted(est, reverse=True):
        if upper <= best:  # neither this x nor any later one can raise the max
            break
        eligible = sorted(range(m), key=rank.__getitem__)
        best = max(best, _knapsack_candidate(rows, eligible, x, cells, eval_s, total, full))
    return best


def _knapsack_candidate(rows: list[tuple], eligible: list[int], x: float, cells: int, eval_s: float,
                        total: float, full: float) -> float:
    """x + the tokens not ready by x / full: the fractional knapsack over `eligible` (rows in the
    knapsack's order) with the decode cell-seconds possible before x, summed in that order."""
    capacity = cells * (x - eval_s)
    done = 0.0
    for i in eligible:
        if capacity <= 0:
            break
        _, work, tokens = rows[i]
        take = min(1.0, capacity / work) if work > 0 else 1.0
        done += tokens * take
        capacity -= work * take
    return x + (total - done) / full
