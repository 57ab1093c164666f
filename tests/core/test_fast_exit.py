"""gyre.fast_exit: a process leaves without the interpreter's teardown, and loses nothing by it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from gyre.cell.mpi_link import one_machine_env
from gyre.cluster.local import find_mpiexec

ROOT = Path(__file__).resolve().parents[2]


def test_exit_functions_run_output_is_flushed_and_the_code_kept(tmp_path):
    script = f"""
import atexit, sys
from gyre.fast_exit import exit_now
atexit.register(lambda: open({str(tmp_path / 'ran')!r}, 'w').write('yes'))
sys.stdout.write('buffered, not flushed')
exit_now(3)
print('never reached')
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 3, r.stderr
    assert r.stdout == "buffered, not flushed"
    assert (tmp_path / "ran").read_text() == "yes"


def test_an_mpi_rank_that_leaves_first_does_not_end_the_others(tmp_path):
    """An MPI rank leaves the normal way: one gone by os._exit made mpiexec kill the rest (seen: a
    head killed before it wrote report.json)."""
    marker = tmp_path / "rank0"
    cmd = [find_mpiexec(), "-n", "2", sys.executable, str(ROOT / "tests" / "mpi_scripts" / "fast_exit_ranks.py"),
           str(marker)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=one_machine_env(), timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert marker.read_text() == "rank 0 finished after rank 1 left"
