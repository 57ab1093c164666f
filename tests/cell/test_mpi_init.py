"""`init_mpi`: the PyPI MPICH runs its OFI netmod unless the site chose one (see its docstring:
UCX addresses tore Slurm's pmi2 request lines in CI)."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = ("import os; from gyre.cell.mpi_link import init_mpi; MPI = init_mpi(); "
         "print(os.environ['MPIR_CVAR_CH4_NETMOD'], MPI.COMM_WORLD.Get_size())")


def _run(extra: dict) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MPIR_CVAR", "PMI_", "SLURM_"))}
    r = subprocess.run([sys.executable, "-c", PROBE], env={**env, "PYTHONPATH": str(REPO), **extra},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_ofi_is_the_default_and_mpi_starts_on_it():
    assert _run({}) == ["ofi", "1"]


def test_a_sites_netmod_wins():
    assert _run({"MPIR_CVAR_CH4_NETMOD": "ucx"}) == ["ucx", "1"]
