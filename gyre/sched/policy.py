"""The policy interface and what every policy shares.

A policy is configured once (scheme, staleness, cost hints) and then only answers
``decide(state, now) -> Decision``: pure, no I/O, no sleeping, no clock of its own. Both the live
coordinator and the simulator call it (ARCHITECTURE.md invariant 3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from gyre.config import SchedConfig
from gyre.sched.admission import AdmissionKey, fifo_key
from gyre.sched.state import CellView, ClusterState, Decision, Role, Switch


@dataclass(frozen=True)
class Hints:
    """What a policy may assume about costs; the coordinator fills these from config (live:
    `gyre.sched.runspec.RunSpec.from_config`) or from the cost model (simulated: `gyre.sim.scenario.hints_for`).
    The defaults are config's (`[sched]`: the one source of cost defaults; the simulator's
    `ClusterModel` takes the same), so an unconfigured policy assumes what an unconfigured run does."""
    to_train_s: float = SchedConfig.to_train_s
    to_rollout_s: float = SchedConfig.to_rollout_s
    push_s: float = SchedConfig.push_s
    eval_s: float = SchedConfig.eval_s
    execs_per_cell: float = SchedConfig.execs_per_cell  # E and E-paper: executions one rollout cell serves at near full speed
    cell_scale: float = 1.0          # one cell's throughput in cells of train_tokens_per_s
    train_tokens_per_s: float = SchedConfig.train_tokens_per_s  # per cell
    min_dwell_s: float = SchedConfig.min_dwell_s  # a cell stays in a role at least this long (anti-thrash)
    calls_per_cell: float = SchedConfig.calls_per_cell  # E: calls one rollout cell decodes while each keeps ~80% of its solo speed

    def __post_init__(self) -> None:
        if self.train_tokens_per_s <= 0 or self.cell_scale <= 0:
            raise ValueError("train_tokens_per_s and cell_scale must be positive")


class Policy:
    scheme: str = "?"
    admission_key: AdmissionKey = staticmethod(fifo_key)
    # True declares that `decide` is exactly `Decision(start_groups=start_budget(state))` for every
    # state (no switch, no note): a driver may then start the core's budget itself without building
    # the state (the simulator asks ~100k times a run, most at execution ends that move no budget).
    # A subclass that overrides `decide` and does not declare it again is set back to False.
    starts_budget_only: bool = False

    def __init_subclass__(cls, **kw) -> None:
        super().__init_subclass__(**kw)
        if "decide" in cls.__dict__ and "starts_budget_only" not in cls.__dict__:
            cls.starts_budget_only = False  # its own decide may do more than start the budget

    def __init__(self, staleness: int = 0, hints: Hints | None = None) -> None:
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        self.staleness = staleness
        self.hints = hints or Hints()

    @property
    def label(self) -> str:
        return f"{self.scheme}{self.staleness}"

    def initial_roles(self, cells: int) -> list[Role]:
        """Roles at job start (no switch cost is paid for these)."""
        return [Role.ROLLOUT] * cells

    def decide(self, state: ClusterState, now: float) -> Decision:  # pragma: no cover - abstract
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class CellCounts:
    """What the policies count over the cells, in one pass."""
    live: int             # not failed
    rollout: int          # settled in rollout
    heading_rollout: int  # in rollout or on the way there
    heading_train: int    # training or on the way there
    switching: int        # live cells mid-switch
    first_live: Role | None  # the role of the first live cell (Colocate reads the pool's role from it)


_last_counts: tuple = ((), CellCounts(0, 0, 0, 0, 0, None))


def cell_counts(cells: Iterable[CellView]) -> CellCounts:
    """The cells' counts, worked out once per tuple of views: the simulator hands every decision
    between two role changes the same tuple (~100 decisions per switch), and a policy reads
    several counts each time. The last tuple is kept (held, so its identity is not reused); only
    a tuple is remembered (it and its frozen views cannot change)."""
    global _last_counts
    key, counts = _last_counts
    if cells is key:
        return counts
    live = rollout = hr = ht = switching = 0
    first = None
    for c in cells:
        role = c.role
        if role is Role.FAILED:
            continue
        live += 1
        if first is None:
            first = role
        if role is Role.ROLLOUT:
            rollout += 1
            hr += 1
        elif role is Role.TRAIN:
            ht += 1
        elif role is Role.TO_ROLLOUT:
            hr += 1
            switching += 1
        else:  # TO_TRAIN
            ht += 1
            switching += 1
    counts = CellCounts(live, rollout, hr, ht, switching, first)
    if type(cells) is tuple:
        _last_counts = (cells, counts)
    return counts


def heading_counts(cells: Iterable[CellView]) -> tuple[int, int]:
    """(rollout, train) counting cells on their way to a role as already there."""
    n = cell_counts(cells)
    return n.heading_rollout, n.heading_train


def move(state: ClusterState, now: float, to: Role, n: int, dwell_s: float,
         keep_rollout: int = 0) -> list[Switch]:
    """Switch up to n settled cells to `to`, longest in their role first.

    Cells that entered their role less than dwell_s ago stay, and when leaving rollout at least
    keep_rollout settled rollout cells remain (so running executions keep being served).
    """
    if n <= 0:
        return []
    src = Role.ROLLOUT if to is Role.TRAIN else Role.TRAIN
    pool = sorted((c for c in state.cells if c.role is src and now - c.since >= dwell_s),
                  key=lambda c: (c.since, c.id))
    if src is Role.ROLLOUT:
        n = min(n, cell_counts(state.cells).rollout - keep_rollout)
    return [Switch(c.id, to) for c in pool[:max(0, n)]]


def ceil_div(a: float, b: float) -> int:
    return int(math.ceil(a / b - 1e-12)) if a > 0 else 0
