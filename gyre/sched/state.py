"""What a scheduling policy sees and what it answers: plain, frozen data.

The live coordinator and the simulator both build a :class:`ClusterState` from what they observe
and apply the :class:`Decision` that comes back (ARCHITECTURE.md invariant 3). Times are seconds
on the caller's clock; the policy never reads a clock of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from gyre.config import StalenessRule


class Role(str, Enum):
    ROLLOUT = "rollout"        # serves inference
    TRAIN = "train"            # one data-parallel group of the trainer
    TO_TRAIN = "to_train"      # switching rollout -> train (weights/KV released, trainer joins)
    TO_ROLLOUT = "to_rollout"  # switching train -> rollout (engine resumes, weights loaded)
    FAILED = "failed"          # out of service; never assigned

    @property
    def settled(self) -> bool:
        return self in (Role.ROLLOUT, Role.TRAIN)

    @property
    def heading(self) -> "Role":
        """The role this cell is in or on its way to."""
        return _HEADING[self]


_HEADING = {r: {Role.TO_TRAIN: Role.TRAIN, Role.TO_ROLLOUT: Role.ROLLOUT}.get(r, r) for r in Role}


@dataclass(frozen=True, slots=True)
class CellView:
    id: int
    role: Role
    since: float  # when the cell entered `role`


@dataclass(frozen=True, slots=True)
class ExecView:
    """One running execution (started, not yet ended). What changes with every call (calls in
    flight) is counted in ClusterState, so a view is rebuilt only when executions start or end."""
    id: int
    group: int
    version: int      # policy version of its first call: the oldest that served it
    started_at: float


class RunningViews(Sequence):
    """The running executions a ClusterState shows: an immutable sequence of ExecView read from
    the coordinator's table without a copy. The coordinator calls `_freeze` before it changes the
    table (copy-on-write), so a state kept by anyone still shows what it showed; a state dropped
    after its decision costs nothing. (A simulated step decides thousands of times over thousands
    of executions; copying them each time was most of a decision's cost.)"""
    __slots__ = ("_src", "_n", "_items", "__weakref__")

    def __init__(self, src: dict) -> None:
        self._src: dict | None = src
        self._n = len(src)
        self._items: tuple | None = None

    def _freeze(self) -> None:
        if self._items is None:
            self._items = tuple(self._src.values())
            self._src = None

    def _tuple(self) -> tuple:
        self._freeze()
        return self._items

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        return self._tuple()[i]

    def __iter__(self):
        return iter(self._tuple())

    def __eq__(self, other) -> bool:
        if isinstance(other, (RunningViews, tuple)):
            return self._tuple() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._tuple())

    def __reduce__(self):
        return tuple, (self._tuple(),)  # a plain tuple once it leaves the process

    def __repr__(self) -> str:
        return f"RunningViews({self._tuple()!r})"


@dataclass(frozen=True, slots=True)
class ClusterState:
    """Everything a policy may use. Counts of groups; work in training tokens."""
    version: int                 # policy version being served (= optimizer steps done)
    staleness: int               # bound k: a group of version v trains in step s only if s - v <= k
    groups_per_step: int         # Q: groups one optimizer step consumes
    group_size: int              # G: executions per group
    cells: tuple[CellView, ...]
    running: Sequence[ExecView]   # a tuple, or the coordinator's RunningViews
    groups_open: int             # started groups not yet trained or dropped (in-flight budget use)
    groups_waiting: int          # evaluated groups not yet assigned to a step, still admissible
    step_groups: int             # groups assigned to the open step so far (<= groups_per_step)
    train_tokens_left: float     # assigned to the open step and not yet trained
    train_tokens_done: float = 0.0  # trained so far in the open step
    starts_blocked: bool = False  # the caller has no more work to start (end of the run)
    starts_allowed: int | None = None  # groups the staleness rule lets start now (None: window rule)
    steps_per_sync: int = 1      # optimizer steps per rollout round (weights pushed once per round)
    staleness_rule: StalenessRule = StalenessRule.WINDOW  # "window" (hard lag bound) or "count" (AReaL's start bound)
    # The open step is full and all of its work is trained: only its optimizer step is left, and
    # that needs a trainer. True with no work at all when every execution of the step had zero
    # advantage (equal rewards): a policy that waits for work before training would wait forever.
    step_ready: bool = False
    calls_in_flight: int = 0     # model calls of running executions in flight right now

    def count(self, *roles: Role) -> int:
        return sum(1 for c in self.cells if c.role in roles)

    @property
    def step_full(self) -> bool:
        return self.step_groups >= self.groups_per_step


@dataclass(frozen=True, slots=True)
class Switch:
    cell: int
    to: Role  # Role.ROLLOUT or Role.TRAIN


@dataclass(frozen=True, slots=True)
class Decision:
    switches: tuple[Switch, ...] = ()
    start_groups: int = 0   # new groups (of G executions each) to start now
    notes: tuple[str, ...] = field(default=(), compare=False)  # why, for logs; never parsed


@dataclass(frozen=True, slots=True)
class GroupView:
    """An evaluated group waiting for a training step."""
    id: int
    version: int          # oldest policy version that served any of its executions
    ready_at: float       # when its last execution was evaluated
    train_tokens: float
