"""Control messages between the head (MPI rank 0) and the cell agents (ranks 1..N).

Small, typed and pickled (mpi4py's lowercase send/recv). The head sends one `Command` at a time
to a cell and gets exactly one `Reply` with the same ``seq``; agents also send unsolicited
`Event`s (hello, heartbeat, a child process restarted). Bulk tensors travel only in ``train``
(one micro-batch as numpy arrays) and in the gradient all-reduce, never in replies.

Command kinds and their ``args`` (the agent answers each with ``Reply.phases`` = seconds per phase):

``to_train``      {version, checkpoint}          drain + release engine memory, restore trainer,
                                                 load the checkpoint if the trainer is behind
``to_rollout``    {version, weights}             stash this step's gradients, offload trainer,
                                                 resume engine memory, load ``weights`` if behind
``push_weights``  {version, weights}             engine /update_weights_from_disk
``train``         {step, mb_id, batch}           forward+backward of one micro-batch (gradients
                                                 accumulate in the trainer); info: stats
``prepare_reduce``{step}                         pull this step's gradients into the agent;
                                                 info: {mb_ids, lost}: micro-batches whose
                                                 gradients died with a killed trainer
``reduce``        {step, participants, leader,   all-reduce (sum) over exactly ``participants``
                   weights_dir, checkpoint_dir}  (a communicator made for them), optimizer step
                                                 on train cells, the leader exports weights and
                                                 writes the checkpoint; info: {grad_norm, version}
``stop``          {}                             end children, exit
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

TAG_COMMAND = 11
TAG_REPLY = 12
TAG_EVENT = 13
TAG_REDUCE = 14  # reserved for data traffic inside a reduce

COMMANDS = ("to_train", "to_rollout", "push_weights", "train", "prepare_reduce", "reduce", "stop")
EVENTS = ("hello", "heartbeat", "engine_restarted", "trainer_restarted", "fatal")

_seq = itertools.count(1)


@dataclass
class Command:
    kind: str
    args: dict[str, Any] = field(default_factory=dict)
    seq: int = field(default_factory=lambda: next(_seq))

    def __post_init__(self) -> None:
        if self.kind not in COMMANDS:
            raise ValueError(f"unknown command {self.kind!r}; known: {', '.join(COMMANDS)}")


@dataclass
class Reply:
    seq: int
    cell: int
    kind: str
    ok: bool
    phases: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    error: str = ""


@dataclass
class Event:
    cell: int
    kind: str
    info: dict[str, Any] = field(default_factory=dict)
    t: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in EVENTS:
            raise ValueError(f"unknown event {self.kind!r}; known: {', '.join(EVENTS)}")
