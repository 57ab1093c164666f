"""Leave a finished process without the interpreter's teardown.

A Gyre child process that imported torch and joined a process group (the trainer ranks) or serves
HTTP with a model loaded (the embedded engine) spends 1-2 s after its main function returns in
module teardown and C++ destructors: measured on a 2-cell `gyre run`, the trainer ranks took 1.8 s
from their last line to their exit. Their cell waits for them at every job's end and every trainer
restart, on the critical path of a preemption's requeue. Every exit function still runs here
(logging, wandb, concurrent.futures and multiprocessing joins, tempfile cleanup), in the order the
interpreter would run them; only the teardown after them is skipped. No library offers this:
`os._exit` alone would skip the exit functions too.

MPI ranks (the head and the cell agents) leave the normal way: tried there, mpiexec's clean-up
took a rank that left by os._exit after MPI_Finalize for a failed one and SIGKILLed the job's
other ranks (seen in 2 of 3 two-cell runs), so `exit_now` falls back to `sys.exit` wherever
mpi4py's MPI module is loaded.
"""

from __future__ import annotations

import atexit
import os
import sys


def exit_now(code: int | None) -> None:
    """Run the exit functions, flush stdout/stderr and end the process with ``code`` (None: 0)."""
    if "mpi4py.MPI" in sys.modules:
        sys.exit(code)
    try:
        atexit._run_exitfuncs()  # what Py_FinalizeEx runs first; CPython has called it this since 2.x
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: nothing left to say there
                pass
        os._exit(0 if code is None else int(code))
