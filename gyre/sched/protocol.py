"""Control messages between the head (MPI rank 0) and the cell agents (ranks 1..N).

One dataclass per head->agent command and one per reply, all `gyre.messages.Message`s (``name``
is what errors and logs call them); the agent picks its handler from a table keyed by the
command's class (``CellAgent.HANDLERS``, built and read with gyre.messages as the trainer ranks'
is). Small and pickled (mpi4py's lowercase send/recv):
the head sends one command at a time to a cell and gets exactly one reply with the same ``seq``;
agents also send unsolicited `Event`s (hello, heartbeat, a child process restarted). Bulk data
travels only in `Train` (one micro-batch as numpy arrays); gradients never cross this link (they
are reduced over torch.distributed groups among the trainer ranks, gyre.cell.groups).

Lost micro-batches (their gradients died with a trainer) are reported once, in the next reply
that has a ``lost`` field (train, prepare_reduce, reduce); the head hands them out again.

Every reply carries ``ok``, ``error`` (why not ok), ``phases`` (seconds per phase) and the cell's
``role`` afterwards. A failed `Reduce` with ``retry=True`` changed nothing anywhere (no cell
applied the step): the head hands ``lost`` micro-batches out again and repeats the reduce.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

from gyre.messages import Message
from gyre.sched.state import Role  # the one role type, head and agents

TAG_COMMAND = 11
TAG_REPLY = 12
TAG_EVENT = 13
TAG_STORE = 14  # agent of cell 0 -> the other agents: where the job's trainer store listens

class EventKind(StrEnum):
    """What an agent tells the head unasked (a StrEnum: logs and reports keep the same words)."""
    HELLO = "hello"                          # its engine serves: engine_url, hostname
    HEARTBEAT = "heartbeat"
    ENGINE_RESTARTED = "engine_restarted"    # engine_url of the new engine
    TRAINER_RESTARTED = "trainer_restarted"
    FATAL = "fatal"                          # the agent cannot go on


EVENTS = tuple(EventKind)

_seq = itertools.count(1)


def _next_seq() -> int:
    return next(_seq)


# --- commands (head -> agent) ------------------------------------------------------------------------

@dataclass(kw_only=True)
class Command(Message):
    name: ClassVar[str] = "command"
    seq: int = field(default_factory=_next_seq)


@dataclass(kw_only=True)
class ToTrain(Command):
    """Drain and release the engine's memory, restore the trainer, load ``checkpoint`` if behind."""
    name: ClassVar[str] = "to_train"
    version: int
    checkpoint: str | None = None
    update: int = 0                   # updates the open step has applied (train.minibatches_per_step)
    drain_timeout_s: float = 30.0


@dataclass(kw_only=True)
class ToRollout(Command):
    """Stash this step's gradients (they stay in the trainer ranks), offload the trainer, resume
    the engine's memory and load ``weights`` if it serves an older version."""
    name: ClassVar[str] = "to_rollout"
    version: int | None = None
    weights: str | None = None


@dataclass(kw_only=True)
class PushWeights(Command):
    """The engine loads ``weights`` (``/update_weights_from_disk``)."""
    name: ClassVar[str] = "push_weights"
    version: int
    weights: str


@dataclass(kw_only=True)
class Train(Command):
    """Forward+backward of one micro-batch over the cell's trainer ranks (gradients accumulate)
    for update ``update`` of the step; ``prox``: only pi_prox, its targets' log-probs at the
    step's start (no gradient), answered in ``logprobs``."""
    name: ClassVar[str] = "train"
    step: int
    mb_id: int
    batch: dict
    update: int = 0
    prox: bool = False


@dataclass(kw_only=True)
class PrepareReduce(Command):
    """Sum this step's gradients over the cell's ranks (held in the trainer ranks)."""
    name: ClassVar[str] = "prepare_reduce"
    step: int
    update: int = 0


@dataclass(kw_only=True)
class Reduce(Command):
    """Sum the held gradients over exactly ``participants`` (a torch.distributed group per
    membership); the leader applies, exports the weights to ``weights_dir`` (one piece per rank;
    ``final`` updates only) and writes ``checkpoint_dir``, then commits; the other train cells
    apply after the commit. ``update``/``final``: which optimizer update of the step this is
    (train.minibatches_per_step); only the final one counts the step."""
    name: ClassVar[str] = "reduce"
    step: int
    update: int = 0
    final: bool = True
    participants: list[int]
    leader: int
    weights_dir: str
    checkpoint_dir: str
    timeout_s: float = 600.0


@dataclass(kw_only=True)
class Stop(Command):
    """End the engine and the trainer ranks, then the agent."""
    name: ClassVar[str] = "stop"


COMMANDS: dict[str, type[Command]] = {c.name: c for c in (ToTrain, ToRollout, PushWeights, Train, PrepareReduce,
                                                          Reduce, Stop)}


# --- replies (agent -> head) -------------------------------------------------------------------------

@dataclass(kw_only=True)
class Reply(Message):
    name: ClassVar[str] = "reply"
    seq: int
    cell: int
    ok: bool = True
    error: str = ""
    role: Role = Role.ROLLOUT
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def info(self) -> dict[str, Any]:
        """The reply's own fields as a dict (read-only view, for logs and reports)."""
        base = {f.name for f in dataclasses.fields(Reply)}
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in base}
        out["role"] = self.role.value
        return out


@dataclass(kw_only=True)
class ToTrainReply(Reply):
    name: ClassVar[str] = "to_train"
    version: int | None = None
    aborted: int = 0
    trainer_pid: int | None = None
    already: bool = False


@dataclass(kw_only=True)
class ToRolloutReply(Reply):
    name: ClassVar[str] = "to_rollout"
    weight_version: str = ""
    held_mbs: list[int] = field(default_factory=list)
    already: bool = False


@dataclass(kw_only=True)
class PushWeightsReply(Reply):
    name: ClassVar[str] = "push_weights"
    weight_version: str = ""


@dataclass(kw_only=True)
class TrainReply(Reply):
    name: ClassVar[str] = "train"
    mb_id: int | None = None
    stats: dict[str, float] = field(default_factory=dict)
    logprobs: list[float] | None = None  # prox: the targets' log-probs at the step's start
    lost: list[int] = field(default_factory=list)   # micro-batches whose gradients died (a trainer death)


@dataclass(kw_only=True)
class PrepareReduceReply(Reply):
    name: ClassVar[str] = "prepare_reduce"
    mb_ids: list[int] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)


@dataclass(kw_only=True)
class ReduceReply(Reply):
    name: ClassVar[str] = "reduce"
    version: int | None = None
    mb_ids: list[int] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)
    retry: bool = False               # failed before any cell applied the step: repeat it
    grad_norm: float | None = None
    weights: str | None = None        # leader: the exported directory
    checkpoint: str | None = None     # leader: the checkpoint directory
    group_form_ms: float = 0.0        # forming the cross-cell group (0 when cached)
    group_cached: bool = False
    caught_up: bool = False           # the trainer died applying; it loaded the leader's checkpoint


@dataclass(kw_only=True)
class StopReply(Reply):
    name: ClassVar[str] = "stop"


REPLIES: dict[type[Command], type[Reply]] = {ToTrain: ToTrainReply, ToRollout: ToRolloutReply,
                                             PushWeights: PushWeightsReply, Train: TrainReply,
                                             PrepareReduce: PrepareReduceReply, Reduce: ReduceReply, Stop: StopReply}


def reply_for(cmd: Command, cell: int, **fields) -> Reply:
    """The reply class that answers ``cmd`` (an unknown command gets a plain failed Reply)."""
    return REPLIES.get(type(cmd), Reply)(seq=cmd.seq, cell=cell, **fields)


@dataclass
class Event(Message):
    name: ClassVar[str] = "event"
    cell: int
    kind: EventKind
    info: dict[str, Any] = field(default_factory=dict)
    t: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in EVENTS:  # checked once, where the agent builds it
            raise ValueError(f"unknown event {self.kind!r}; known: {', '.join(EVENTS)}")
        self.kind = EventKind(self.kind)
