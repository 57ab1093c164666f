"""Elastic (E): training gets the cells the running executions do not need, as many as its work keeps busy.

The rollout side needs one cell per `calls_per_cell` model calls (each call keeps ~80% of its solo
decode speed, from the decode model), counting the larger of the calls in flight now and the calls
its running executions make on average (`execs_per_cell` executions a cell: calls_per_cell over the
share of an execution's time spent in calls; the calls in flight alone swing with every tool
call). Every other cell is *spare*. Spare cells train the admitted, untrained work of the open step,
as many as it keeps busy longer than a switch each; trainers stay (idle trainers cost nothing a
rollout cell would not) until the rollout side needs them. When nothing runs and nothing may start
(the end of a step at staleness 0), rollout cells join training where that finishes the step
sooner, counting their switch and, for the last one, its way back. At least one cell serves while
any execution runs, except with a single cell, where E *is* Colocate (the one cell trains once the
step's batch is complete and the harnesses wait).

At staleness 0 training never takes a cell the running executions need, however much work waits:
they are the critical path (the step cannot end before its last execution does, so the admitted
work has until then). A rollout cell lent to training slows every call left on the others: sizing
trainers to clear the work within a 600 s switch horizon took 7 of 8 cells from 467 running
executions of the 122B preset at staleness 0 and made E 3.9% slower than E-paper, which sizes
rollout first (tests/sched/test_elastic_grid.py). At staleness > 0 executions always run (new
groups start while the step trains), so spare cells alone left training behind: trainers busy all
the time, too few, and the staleness window holding back new starts (the 122B preset, k = 2, 24
steps: 117.8 h, none dropped, against Async's 90.6 h). There training also gets the cells its
admitted work keeps busy over a 600 s horizon (a switch round trip costs 2% of it): 84.4 h, 445
groups dropped.

The paper's own rule is kept as scheme "E-paper" (gyre/sched/elastic_paper.py).
"""

from __future__ import annotations

from gyre.config import Scheme
from gyre.sched.admission import oldest_version_key, start_budget
from gyre.sched.fixed import ColocatePolicy
from gyre.sched.policy import Hints, Policy, ceil_div, cell_counts, move
from gyre.sched.state import ClusterState, Decision, Role


SWITCH_SHARE = 0.02  # at staleness > 0 a training cell's switches cost at most 2% of its busy time


class ElasticPolicy(Policy):
    scheme = Scheme.E
    admission_key = staticmethod(oldest_version_key)  # the order that drops fewest groups

    def __init__(self, staleness: int = 0, hints: Hints | None = None) -> None:
        super().__init__(staleness, hints)
        self._one_cell = ColocatePolicy(staleness, self.hints)

    @property
    def horizon_s(self) -> float:
        """At staleness > 0, how long the admitted work may keep a training cell busy: a round trip
        of switches costs SWITCH_SHARE of it (600 s with the paper's 8.52 s + 3.46 s)."""
        h = self.hints
        return max(1.0, (h.to_train_s + h.to_rollout_s) / SWITCH_SHARE)

    def rollout_need(self, state: ClusterState, starting: int) -> int:
        """Rollout cells the running executions (and those about to start) need for each call to
        keep ~80% of its solo decode speed (`calls_per_cell`): by the calls in flight now, or by the
        calls the executions make on average (`execs_per_cell`), whichever asks more: an execution
        between two calls is about to make the next one."""
        h = self.hints
        new = starting * state.group_size
        by_calls = ceil_div(state.calls_in_flight + new, h.calls_per_cell)
        by_execs = ceil_div(len(state.running) + new, h.execs_per_cell * h.cell_scale)
        return max(1, by_calls, by_execs)

    def train_target(self, state: ClusterState, t: int, live: int, need: int) -> int:
        """Training cells while executions run: only spare cells (those the rollout side does not
        need), as many as the admitted work keeps busy longer than a switch each; trainers stay
        until the rollout side needs them."""
        h = self.hints
        rate = h.train_tokens_per_s * h.cell_scale
        spare = max(0, live - need)
        want = min(t, spare)  # trainers stay while the rollout side has every cell it can use
        left = state.train_tokens_left
        if left > 0:
            want = max(want, min(spare, ceil_div(left, rate * h.to_train_s)))
            if self.staleness > 0:  # the optimizer must keep pace, or the running groups go stale
                want = max(want, ceil_div(left, rate * self.horizon_s))
        if state.step_ready:
            want = max(want, 1)  # only the optimizer step is left (possibly of a zero-work step)
        return min(want, live - 1)

    def idle_joiners(self, state: ClusterState, t: int, r: int) -> int:
        """Nothing runs and nothing may start (the end of a step at staleness 0): how many of the r
        rollout cells should join the t trainers. A joiner helps after its switch; the last rollout
        cell leaving makes the next step wait for one to come back."""
        h = self.hints
        rate = h.train_tokens_per_s * h.cell_scale
        left = max(state.train_tokens_left, 0.0)

        def finish(n: int) -> float:
            if t == 0:
                return h.to_train_s + left / (n * rate)
            if left <= t * rate * h.to_train_s:
                return left / (t * rate)
            return h.to_train_s + (left - t * rate * h.to_train_s) / ((t + n) * rate)

        options = range(0 if t else 1, r + 1)
        return min(options, key=lambda n: (finish(n) + (h.to_rollout_s if n == r else 0.0), n))

    def decide(self, state: ClusterState, now: float) -> Decision:
        n = cell_counts(state.cells)
        if n.live == 1:
            return self._one_cell.decide(state, now)
        budget = start_budget(state)
        settled_rollout = n.rollout
        starting = budget if settled_rollout else 0  # new executions start on a settled rollout cell
        running = bool(state.running) or budget > 0
        r, t = n.heading_rollout, n.heading_train
        work = state.train_tokens_left > 0 or state.step_ready
        if not running:
            want = t + self.idle_joiners(state, t, r) if work else t
        else:
            want = self.train_target(state, t, n.live, self.rollout_need(state, budget))
        dwell = self.hints.min_dwell_s
        if want > t:
            sw = move(state, now, Role.TRAIN, want - t, dwell, keep_rollout=1 if running else 0)
        elif want < t:
            # an unserved execution overrides the dwell time
            sw = move(state, now, Role.ROLLOUT, t - want, 0.0 if running and settled_rollout == 0 else dwell)
        else:
            sw = []
        return Decision(tuple(sw), start_groups=starting)
