"""Elastic (E): training gets the cells its admitted work keeps busy; every other cell decodes.

Training demand is the admitted, untrained work of the open step. It gets
ceil(work / (one cell's training rate x horizon)) cells, where the horizon is how long a switch
must pay for itself: a round trip of switches (rollout -> train -> rollout) costs at most
`switch_share` of the time a cell spends training, so horizon = round trip / switch_share (600 s
with the paper's 8.52 s + 3.46 s and 2%). Every other cell keeps decoding, so the rollout side
never loses throughput to cells that would idle in training. Rollout cells the calls
in flight do not need (past `calls_per_cell` calls per cell, where each call keeps ~80% of its
solo decode speed) also train while the admitted work keeps each busy longer than its switch. A trainer goes back to rollout once the admitted
work is trained (and it has stayed `min_dwell_s`). When nothing runs and nothing may
start (the end of a step at staleness 0), rollout cells join training where that finishes the
step sooner, counting their switch and, for the last one, its way back. At least one cell serves while any
execution runs, except with a single cell, where E *is* Colocate (the one cell trains once the
step's batch is complete and the harnesses wait).

The paper's own rule is kept as scheme "E-paper" (gyre/sched/elastic_paper.py).
"""

from __future__ import annotations

from gyre.config import Scheme
from gyre.sched.admission import oldest_version_key, start_budget
from gyre.sched.fixed import ColocatePolicy
from gyre.sched.policy import Hints, Policy, ceil_div, heading_counts, move
from gyre.sched.state import ClusterState, Decision, Role


class ElasticPolicy(Policy):
    scheme = Scheme.E
    admission_key = staticmethod(oldest_version_key)  # the order that drops fewest groups

    def __init__(self, staleness: int = 0, hints: Hints | None = None) -> None:
        super().__init__(staleness, hints)
        self._one_cell = ColocatePolicy(staleness, self.hints)

    @property
    def horizon_s(self) -> float:
        """How long the admitted work should keep a training cell busy (see the module doc)."""
        h = self.hints
        return max(1.0, (h.to_train_s + h.to_rollout_s) / h.switch_share)

    def rollout_need(self, state: ClusterState, starting: int) -> int:
        """Rollout cells the calls in flight (and the executions about to start) need for each to
        keep ~80% of its solo decode speed (`calls_per_cell`, from the decode model): a further
        rollout cell speeds decoding little, a training cell shortens the step."""
        calls = state.calls_in_flight + starting * state.group_size
        return max(1, ceil_div(calls, self.hints.calls_per_cell))

    def train_target(self, state: ClusterState, t: int, live: int, need: int) -> int:
        """Training cells: as many as the admitted work keeps busy over the horizon; cells the
        rollout side cannot use also train while the work keeps each busy longer than its switch, and stay
        (idle trainers cost nothing a rollout cell would not) until rollout needs them."""
        h = self.hints
        rate = h.train_tokens_per_s * h.cell_scale
        left = state.train_tokens_left
        spare = max(0, live - need)
        want = min(t, spare)  # trainers stay while the rollout side has every cell it can use
        if left > 0:
            want = max(want, ceil_div(left, rate * self.horizon_s),
                       min(spare, ceil_div(left, rate * h.to_train_s)))
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
        live = [c for c in state.cells if c.role is not Role.FAILED]
        if len(live) == 1:
            return self._one_cell.decide(state, now)
        budget = start_budget(state)
        settled_rollout = state.count(Role.ROLLOUT)
        starting = budget if settled_rollout else 0  # new executions start on a settled rollout cell
        running = bool(state.running) or budget > 0
        r, t = heading_counts(state.cells)
        work = state.train_tokens_left > 0 or state.step_ready
        if not running:
            want = t + self.idle_joiners(state, t, r) if work else t
        else:
            want = self.train_target(state, t, len(live), self.rollout_need(state, budget))
        dwell = self.hints.min_dwell_s
        if want > t:
            sw = move(state, now, Role.TRAIN, want - t, dwell, keep_rollout=1 if running else 0)
        elif want < t:
            # an unserved execution overrides the dwell time
            sw = move(state, now, Role.ROLLOUT, t - want, 0.0 if running and settled_rollout == 0 else dwell)
        else:
            sw = []
        return Decision(tuple(sw), start_groups=starting)
