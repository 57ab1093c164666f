"""The cell agent's process entry: ranks >= 1 of a job (``gyre.cluster.main`` calls :func:`main`
with the placement builder of the job's kind, local processes or a Slurm step).

A cell that cannot start still answers the head (ok=False) until ``stop``: exiting early would
make the MPI launcher end the whole job, head included.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Callable

from gyre.cell import mpi_link
from gyre.cell.agent import CellAgent
from gyre.cell.placement import Placement
from gyre.config import GyreConfig, env, load_config
from gyre.sched.protocol import Event, Stop, reply_for

# (configuration, run directory, cell) -> where that cell's processes run
PlaceCell = Callable[[GyreConfig, Path, int], Placement]


def read_key_file(path: str | os.PathLike) -> str:
    p = Path(path)
    mode = p.stat().st_mode & 0o777
    if mode & 0o077:
        raise PermissionError(f"engine key file {p} is readable by others (mode {mode:o}); chmod 600 it")
    key = p.read_text(encoding="utf-8").strip()
    if not key:
        raise ValueError(f"engine key file {p} is empty")
    return key


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", required=True, help="the run directory (shared with the head)")
    p.add_argument("--model", required=True, help="initial model directory (transformers layout)")
    p.add_argument("--config", default=None, help="Gyre TOML config file")
    p.add_argument("--engine-key-file", default=None,
                   help="file (mode 600) holding the job's engine API key; default $GYRE_ENGINE_KEY_FILE")
    p.add_argument("overrides", nargs="*", help="section.key=value configuration overrides")


def serve_failed(comm, error: str) -> int:
    """Answer every command ok=False (``stop`` ok=True) until ``stop``, then exit 0."""
    cell = mpi_link.rank_cell(comm.Get_rank())
    while True:
        cmd = mpi_link.recv_command(comm, 1.0)
        if cmd is None:
            continue
        stopped = isinstance(cmd, Stop)
        mpi_link.send_reply(comm, reply_for(cmd, cell, ok=stopped,
                                            error="" if stopped else f"cell {cell} failed to start: {error}"))
        if stopped:
            return 0  # the failure went to the head as Event fatal; the head owns the job's status


def main(argv: list[str] | None, place: PlaceCell) -> int:
    p = argparse.ArgumentParser(prog="gyre cell agent", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    MPI = mpi_link.init_mpi()  # here, not at import: importing mpi4py initialises MPI

    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 0:
        print("cell_agent: rank 0 is the head; run the agent on ranks >= 1", file=sys.stderr)
        return 2
    # srun/mpiexec end a job with SIGTERM: unwind, so that the engine and trainer go too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cell = mpi_link.rank_cell(comm.Get_rank())
    agent = None
    try:
        cfg = load_config(args.config, args.overrides)
        key_file = args.engine_key_file or env("GYRE_ENGINE_KEY_FILE")
        if not key_file:
            raise ValueError("no engine key: give --engine-key-file or set GYRE_ENGINE_KEY_FILE")
        api_key = read_key_file(key_file)
        agent = CellAgent(comm, cfg, place(cfg, Path(args.run_dir), cell), run_dir=args.run_dir,
                          model_dir=args.model, api_key=api_key, config_file=args.config, overrides=args.overrides)
        agent.start()
    except Exception as e:  # the head hears why instead of waiting for a hello that never comes
        error = f"{type(e).__name__}: {e}"
        print(f"cell_agent {cell}: cannot start: {error}", file=sys.stderr)
        if agent is not None:
            with contextlib.suppress(Exception):
                agent.close()
        mpi_link.send_event(comm, Event(cell=cell, kind="fatal", info={"what": "start", "error": error}))
        return serve_failed(comm, error)
    try:
        return agent.run()
    finally:
        with contextlib.suppress(Exception):
            agent.close()
