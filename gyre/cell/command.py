"""What every command handler of the cell agent shares: its error and its phase timer."""

from __future__ import annotations

import contextlib
import time


class CommandError(RuntimeError):
    """A command cannot be carried out; the message goes to the head as Reply.error."""


@contextlib.contextmanager
def timed(phases: dict, name: str):
    t0 = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0
