"""The messages between a cell's agent (gyre.cell.trainer_process) and its trainer ranks (gyre.cell.trainer_rank).

One small dataclass per request, carrying its arguments as fields, and one per reply that a
caller reads fields of. They travel pickled over the ``multiprocessing.connection`` pipe between
the agent and rank 0 and over the cell's ``broadcast_object_list`` to the other ranks, so every
field is a plain picklable value (a micro-batch in its :func:`gyre.batch.to_wire` form). Every
message is a `gyre.messages.Message` (``name``: what errors and timeouts call it), the family
the head<->agent protocol (gyre.sched.protocol) is of too; the rank side dispatches on the
request's type (``Rank.HANDLERS``, built and read with gyre.messages as the agent's is).

Free-form statistics (a micro-batch's merged stats, offload/restore timings) stay dicts: their
keys are the trainer's and go on unread into replies and logs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from gyre.messages import Message


# --- requests (agent -> ranks) -----------------------------------------------------------------
@dataclass(frozen=True)
class Request(Message):
    name: ClassVar[str] = "request"


@dataclass(frozen=True)
class Start(Request):
    """The first message to rank 0: what every rank builds its trainer from."""
    name: ClassVar[str] = "start"
    cfg: dict                    # dataclasses.asdict(TrainConfig)
    model_dir: str
    seed: int = 0
    offloaded: bool = False
    checkpoint: str | None = None
    init_state: str | None = None   # model.init_optimizer = "carried": model and optimizer at step 0


@dataclass(frozen=True)
class ForwardBackward(Request):
    """One micro-batch, its rows split over the cell's data-parallel ranks."""
    name: ClassVar[str] = "forward_backward"
    wire_mb: dict
    step: int = 0
    update: int = 0              # the minibatch (optimizer update) of the step it belongs to


@dataclass(frozen=True)
class Logprobs(Request):
    """pi_prox: the current log-probs of one micro-batch's targets (no gradient), rows split
    over the cell's data-parallel ranks and put back in target order."""
    name: ClassVar[str] = "logprobs"
    wire_mb: dict


@dataclass(frozen=True)
class Stash(Request):
    """Sum this step's gradients over the cell's ranks into the ranks' held vector."""
    name: ClassVar[str] = "stash"
    step: int
    update: int = 0


@dataclass(frozen=True)
class ReduceGrads(Request):
    """Sum the held gradients over the member cells (cross-cell groups)."""
    name: ClassVar[str] = "reduce"
    step: int
    members: tuple[int, ...]     # sorted cell ids
    attempt: int
    update: int = 0


@dataclass(frozen=True)
class Apply(Request):
    """The optimizer update with the last reduce's sum; ``final``: the step's last (counted)."""
    name: ClassVar[str] = "apply"
    step: int
    update: int = 0
    final: bool = True


@dataclass(frozen=True)
class Offload(Request):
    name: ClassVar[str] = "offload"


@dataclass(frozen=True)
class Restore(Request):
    name: ClassVar[str] = "restore"


@dataclass(frozen=True)
class SaveCheckpoint(Request):
    name: ClassVar[str] = "save_checkpoint"
    path: str


@dataclass(frozen=True)
class LoadCheckpoint(Request):
    name: ClassVar[str] = "load_checkpoint"
    path: str


@dataclass(frozen=True)
class ExportWeights(Request):
    name: ClassVar[str] = "export_weights"
    out_dir: str
    version: int | str


@dataclass(frozen=True)
class Hostnames(Request):
    name: ClassVar[str] = "hostname"


@dataclass(frozen=True)
class Close(Request):
    """The ranks exit (also what rank 0 makes of a closed pipe)."""
    name: ClassVar[str] = "close"


# --- replies (ranks -> agent) ------------------------------------------------------------------
@dataclass(frozen=True)
class Started(Message):
    name: ClassVar[str] = "started"
    num_grad_elements: int
    ranks: int


@dataclass(frozen=True)
class Stashed(Message):
    name: ClassVar[str] = "stashed"
    held: bool                   # the ranks hold gradients of the step


@dataclass(frozen=True)
class GradsReduced(Message):
    name: ClassVar[str] = "grads_reduced"
    form_ms: float               # forming the cross-cell group (0 when cached); the cell's slowest rank
    cached: bool                 # every rank found the membership's group formed already
    wait_ms: float
    grad_norm_total: float       # norm of the summed gradients


@dataclass(frozen=True)
class Applied(Message):
    name: ClassVar[str] = "applied"
    step: int                    # the trainer's step (= policy version) after the update
    grad_norm: float
    stats: dict = field(default_factory=dict)  # the whole step's statistics (gyre.train.base)


@dataclass(frozen=True)
class Reply(Message):
    """One answer on the pipe: a value or an error's text, and the trainer's step after it."""
    name: ClassVar[str] = "reply"
    value: Any = None
    error: str | None = None
    step: int | None = None
    update: int | None = None    # updates applied inside the open step (train.minibatches_per_step)

    @property
    def ok(self) -> bool:
        return self.error is None
