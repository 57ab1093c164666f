"""The ground floor of Gyre's typed protocols: a message names itself, and a receiver picks the
handler of a message by its type from one kind of table, refusing an unknown one the same way.

Two protocols stand on it, both pickled dataclasses whose class is the message's type:

* head <-> cell agents over MPI (gyre.sched.protocol: `Command`, `Reply`, `Event`), dispatched by
  ``CellAgent.HANDLERS`` (gyre.cell.agent);
* a cell's agent <-> its trainer ranks over the cell's pipe (gyre.cell.trainer_messages:
  `Request` and the replies), dispatched by ``Rank.HANDLERS`` (gyre.cell.trainer_rank).

``name`` is a class attribute (never pickled, so a message's wire form is its dataclass fields
alone): what errors, logs and timeouts call the message, unique within a table. Imports nothing
of Gyre, so both protocols (one in `sched`, one in `cell`) can build on it.
"""

from __future__ import annotations

import reprlib
from typing import Callable, ClassVar, Mapping, TypeVar

H = TypeVar("H")


class Message:
    """A typed message of one of Gyre's protocols; each subclass sets its own ``name``."""

    name: ClassVar[str] = "message"


def dispatch_table(handlers: Mapping[type, H]) -> dict[type[Message], H]:
    """A receiver's table (message type -> handler), checked once where it is built: every key is
    a `Message` type and no two share a ``name`` (errors would not tell them apart)."""
    named: dict[str, type] = {}
    for t in handlers:
        if not (isinstance(t, type) and issubclass(t, Message)):
            raise TypeError(f"dispatch table key {t!r} is not a gyre.messages.Message type")
        if t.name in named:
            raise ValueError(f"{named[t.name].__name__} and {t.__name__} share the message name {t.name!r}; "
                             "give each its own")
        named[t.name] = t
    return dict(handlers)


def handler_for(table: Mapping[type, H], msg: object, what: str,
                error: Callable[[str], Exception] = TypeError) -> H:
    """The handler of ``msg``'s type in ``table``; for a type it lacks, ``error`` (TypeError
    unless the protocol has its own) saying ``unknown <what> <type>; known: <types>`` (a message
    by its type alone: its fields may be a whole micro-batch; anything else with a short repr)."""
    handler = table.get(type(msg))
    if handler is None:
        got = type(msg).__name__ if isinstance(msg, Message) else f"{type(msg).__name__} {reprlib.repr(msg)}"
        raise error(f"unknown {what} {got}; known: {', '.join(sorted(t.__name__ for t in table))}")
    return handler
