"""Leave a finished process without the interpreter's teardown.

A Gyre process that imported torch and holds a process group or a TCPStore (the head, the cell
agents, the trainer ranks, the embedded engine) spends 1-2 s after its main function returns in
module teardown and C++ destructors: measured on a 2-cell `gyre run`, the trainer ranks took 1.8 s
from their last line to their exit and mpiexec ended 1.3-1.7 s after every rank's main had
returned. A job pays that at its end and at every trainer restart, on the critical path of a
preemption's requeue. Every exit function still runs here (logging, wandb, concurrent.futures
and multiprocessing joins, tempfile cleanup), in the order the interpreter would run them, then
MPI_Finalize (mpi4py's own exit hook); only the teardown after them is skipped. No library offers this:
`os._exit` alone would skip the exit functions too.
"""

from __future__ import annotations

import atexit
import os
import sys


def exit_now(code: int | None) -> None:
    """Run the exit functions, flush stdout/stderr and end the process with ``code`` (None: 0)."""
    try:
        atexit._run_exitfuncs()  # what Py_FinalizeEx runs first; CPython has called it this since 2.x
        mpi = sys.modules.get("mpi4py.MPI")
        # mpi4py finalizes from a C exit hook (Py_AtExit), after the exit functions: a rank that
        # left without MPI_Finalize makes mpiexec end the job's other ranks mid-work
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.Finalize()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: nothing left to say there
                pass
        os._exit(0 if code is None else int(code))
