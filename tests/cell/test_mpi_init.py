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


def test_a_one_machine_job_binds_loopback_whichever_provider_mpich_picks(tmp_path):
    # MPICH prints the provider and network it chose; without FI_SOCKETS_IFACE it chose `sockets`
    # on the first interface (here eth0, in CI a dev cluster's bridge that a parallel test removed)
    from gyre.cell.mpi_link import one_machine_env

    env = {k: v for k, v in one_machine_env().items() if not k.startswith(("PMI_", "SLURM_", "FI_PROVIDER"))}
    env.update(PYTHONPATH=str(REPO), MPIR_CVAR_CH4_NETMOD="ofi", MPIR_CVAR_CH4_OFI_CAPABILITY_SETS_DEBUG="1")
    mpiexec = Path(sys.executable).with_name("mpiexec")
    r = subprocess.run([str(mpiexec), "-n", "2", sys.executable, "-c",
                        "from mpi4py import MPI; c = MPI.COMM_WORLD; s = c.allreduce(c.rank); c.rank or print('sum', s)"],
                       env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "sum 1" in r.stdout.splitlines(), r.stdout  # rank 0 prints it (two ranks' lines interleave)
    chosen = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("libfabric provider:")]
    assert chosen, "MPICH no longer prints its chosen provider: " + (r.stdout + r.stderr)[-2000:]
    assert all(line.endswith("127.0.0.1/32") for line in chosen), chosen
