"""The paper's elastic rule (scheme "E-paper"), kept for comparison with the shipped E.

The rollout side is sized from unfinished rollout work: one rollout cell per `execs_per_cell`
running (or about to start) executions, and never fewer than one while any runs. Once admitted
work exists, every other cell moves to training; cells move back when new rollout work starts.
A cell stays in a role at least `min_dwell_s` unless moving it is needed to keep executions served.

Measured against the demand-sized E (gyre/sched/elastic.py): with little training waiting it
halves rollout and the freed cells idle; under load it wants every cell in rollout while hours
of admitted training wait (docs/scheduling.md).
"""

from __future__ import annotations

from gyre.config import Scheme
from gyre.sched.admission import start_budget
from gyre.sched.policy import Policy, ceil_div, cell_counts, move
from gyre.sched.state import ClusterState, Decision, Role


class ElasticPaperPolicy(Policy):
    scheme = Scheme.E_PAPER

    @property
    def label(self) -> str:
        return f"E{self.staleness}-paper"

    def rollout_target(self, state: ClusterState, now: float, starting: int) -> int:
        """Rollout cells wanted; at least one whenever executions run or start."""
        n = cell_counts(state.cells)
        work = len(state.running) + starting * state.group_size
        need = ceil_div(work, self.hints.execs_per_cell * self.hints.cell_scale)
        if state.train_tokens_left <= 0:
            need = max(need, n.heading_rollout)  # nothing to train: no reason to leave rollout
        return min(n.live, max(need, 1 if work else 0))

    def decide(self, state: ClusterState, now: float) -> Decision:
        n = cell_counts(state.cells)
        settled_rollout = n.rollout
        budget = start_budget(state)
        # Start only once a settled rollout cell will serve the new executions.
        starting = budget if settled_rollout else 0
        target = self.rollout_target(state, now, budget)
        r, t = n.heading_rollout, n.heading_train
        if state.step_ready and t == 0:
            # only the optimizer step is left (a step of zero-advantage executions has no work,
            # so the work-driven target never asks for a trainer): bring one
            target = min(target, r - 1)
        running = bool(state.running) or starting > 0
        dwell = self.hints.min_dwell_s
        if target > r:
            # An unserved execution overrides the dwell time.
            sw = move(state, now, Role.ROLLOUT, target - r, 0.0 if settled_rollout == 0 and (running or budget) else dwell)
        elif target < r:
            sw = move(state, now, Role.TRAIN, r - target, dwell, keep_rollout=1 if running else 0)
        else:
            sw = []
        return Decision(tuple(sw), start_groups=starting)
