"""Two MPI ranks: rank 1 leaves at once through gyre.fast_exit; rank 0 goes on working after rank
1's exit functions have run (as the head writes report.json after its cells have left)."""

import atexit
import sys
import time
from pathlib import Path

from mpi4py import MPI

from gyre.fast_exit import exit_now

comm = MPI.COMM_WORLD
marker, left = Path(sys.argv[1]), Path(sys.argv[1] + ".rank1")
if comm.Get_rank() == 1:
    atexit.register(left.write_text, "exit functions ran")
    exit_now(0)  # the normal exit for an MPI rank; by os._exit, mpiexec ended rank 0 at once
deadline = time.monotonic() + 60
while not left.exists() and time.monotonic() < deadline:
    time.sleep(0.02)
time.sleep(1.0)  # room for mpiexec to act on a rank that left without MPI_Finalize (~0.1 s here)
marker.write_text("rank 0 finished after rank 1 left")
exit_now(0)
