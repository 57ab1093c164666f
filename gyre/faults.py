"""Test-only fault injection at named phases.

Fault tests must not depend on a sleep landing at the right moment, so processes call
``faults.hit("trainer", "reduce")`` at the start of each named phase; when the environment
variable ``GYRE_FAULT`` names that process and phase, the process SIGKILLs itself right there.

``GYRE_FAULT`` is ``process:phase[:nth]``: kill on the nth hit (default 1) of that phase in that
process. Several specs are separated by commas. A marker file in ``GYRE_FAULT_DIR`` (if set)
records that the fault fired, so a restarted process with the same environment does not die
again and the test can assert the fault really happened. Unset (the default), ``hit`` is a dict
lookup and nothing else.

Phases in use (process: phases):
    (every process also has `start`: before it does anything, for the start-up failure tests)
    trainer: micro_batch, prepare_reduce, reduce, optimizer_step, export, checkpoint,
             later_minibatch (a micro-batch of a step's update > 0: an earlier update is applied)
    engine:  generate, release, weight_load
    agent:   command
    head:    step_end, execution_ended, execution_recorded
    rollout: execution_ended, execution_recorded
    proxy:   call_journaled (a call in the journal, its answer not yet sent)
    store:   compacted (a merged shard written, its sources not yet removed)
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

_counts: dict[tuple[str, str], int] = {}


def _specs() -> list[tuple[str, str, int]]:
    raw = os.environ.get("GYRE_FAULT", "")
    out = []
    for part in filter(None, (p.strip() for p in raw.split(","))):
        bits = part.split(":")
        if len(bits) not in (2, 3):
            raise ValueError(f"GYRE_FAULT entry {part!r}: expected process:phase[:nth], e.g. trainer:reduce:2")
        out.append((bits[0], bits[1], int(bits[2]) if len(bits) == 3 else 1))
    return out


def marker(process: str, phase: str, nth: int = 1) -> Path | None:
    d = os.environ.get("GYRE_FAULT_DIR")
    return Path(d) / f"fired-{process}-{phase}-{nth}" if d else None


def fired(process: str, phase: str, nth: int = 1) -> bool:
    m = marker(process, phase, nth)
    return bool(m and m.exists())


def hit(process: str, phase: str) -> None:
    """Called at the start of a named phase; dies here if a test asked for it."""
    if "GYRE_FAULT" not in os.environ:
        return
    key = (process, phase)
    _counts[key] = _counts.get(key, 0) + 1
    for proc, ph, nth in _specs():
        if (proc, ph) == key and _counts[key] == nth:
            m = marker(proc, ph, nth)
            if m is not None:
                if m.exists():  # already fired once: a restarted process runs on
                    return
                m.parent.mkdir(parents=True, exist_ok=True)
                m.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
