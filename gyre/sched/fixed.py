"""The two paper baselines: Async (fixed pools) and Colocate (the whole pool switches)."""

from __future__ import annotations

from gyre.config import Scheme
from gyre.sched.admission import oldest_version_key, start_budget
from gyre.sched.policy import Hints, Policy, cell_counts
from gyre.sched.state import ClusterState, Decision, Role, Switch


class AsyncPolicy(Policy):
    """A fixed rollout pool and a fixed training pool; nothing ever switches."""
    scheme = Scheme.A
    admission_key = staticmethod(oldest_version_key)  # baselines get the order that drops least
    starts_budget_only = True  # decide below: the fixed split only ever starts the budget

    def __init__(self, staleness: int = 0, hints: Hints | None = None, rollout_cells: int = 1) -> None:
        super().__init__(staleness, hints)
        if rollout_cells < 1:
            raise ValueError("async needs at least one rollout cell")
        self.rollout_cells = rollout_cells

    def initial_roles(self, cells: int) -> list[Role]:
        if self.rollout_cells >= cells:
            raise ValueError(f"async: {self.rollout_cells} rollout cells leave none of {cells} to train")
        return [Role.ROLLOUT] * self.rollout_cells + [Role.TRAIN] * (cells - self.rollout_cells)

    def decide(self, state: ClusterState, now: float) -> Decision:
        return Decision(start_groups=start_budget(state))


class ColocatePolicy(Policy):
    """All cells roll out until a step's batch is complete, then all cells train it."""
    scheme = Scheme.C
    admission_key = staticmethod(oldest_version_key)

    def decide(self, state: ClusterState, now: float) -> Decision:
        n = cell_counts(state.cells)
        if n.switching:
            return Decision()  # mid-switch: wait until the whole pool has arrived
        if n.first_live is not Role.TRAIN:
            # (a full step with no work, every reward equal, still needs its optimizer step)
            if state.step_full and (state.train_tokens_left > 0 or state.step_ready):
                return Decision(_switch_live(state, Role.TRAIN), notes=("batch complete",))
            return Decision(start_groups=start_budget(state))
        # Training: stay while the open step's batch is complete (the next one may already be);
        # a partial batch waits in the queue for the next training phase.
        if state.step_full:
            return Decision()
        return Decision(_switch_live(state, Role.ROLLOUT), notes=("step trained",))


def _switch_live(state: ClusterState, to: Role) -> tuple[Switch, ...]:
    return tuple(Switch(c.id, to) for c in state.cells if c.role is not Role.FAILED)
