"""What every MPI rank of a Gyre job runs: rank 0 the head, ranks 1..N the cell agents.

`gyre run` starts this under `mpiexec` on one machine; `launchers/gyre.sbatch` starts it as one
heterogeneous `srun` step on a cluster. Both pass the same arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
from pathlib import Path

from gyre.cell.mpi_link import HeadLink, init_mpi
from gyre.cluster import failed_rank
from gyre.cluster.placement import cell_placement
from gyre.cluster.preflight import preflight
from gyre.config import ConfigError, default_tiny_dir, initial_model, load_config
from gyre.model.tiny import ensure_tiny_model


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gyre.cluster.main")
    p.add_argument("--config")
    p.add_argument("--engine-key-file", required=True, help="0600 file holding the job's engine secret")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--report", help="where rank 0 writes the run report (JSON)")
    p.add_argument("--progress-bar", action="store_true",
                   help="draw a bar of each step's executions (gyre run sets it when its output is a terminal)")
    p.add_argument("overrides", nargs="*")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    MPI = init_mpi()  # here, not at import: importing mpi4py initialises MPI

    args = parse(argv)
    comm = MPI.COMM_WORLD
    if comm.Get_size() < 2:
        print("gyre: a job needs at least 2 MPI ranks (1 head + cells); got 1", file=sys.stderr)
        return 2
    cfg, error = None, None
    try:
        cfg = load_config(args.config, args.overrides)
        preflight(cfg)  # every rank checks (its node's view of the paths): under Slurm nothing checked before
    except ConfigError as e:
        error = str(e)
    errors = comm.gather(error, root=0)  # rank 0 says it once, then every rank ends
    refused = False
    if comm.Get_rank() == 0:
        bad = [(rank, e) for rank, e in enumerate(errors) if e]
        if bad:
            rank, e = bad[0]
            where = f" (rank {rank}{f' and {len(bad) - 1} more' if len(bad) > 1 else ''})" if rank else ""
            print(f"gyre: configuration error{where}: {e}", file=sys.stderr, flush=True)
            refused = True
    # every rank waits here for rank 0's verdict and, refused, exits 2 with MPI finalized: MPI_Abort
    # could end mpiexec before it had forwarded rank 0's line (seen once: exit 2, stderr empty)
    if comm.bcast(refused, root=0):
        return 2
    if comm.Get_rank() != 0:
        return _or_abort(comm, "cell", lambda: run_cell(args), Path(cfg.run.dir))
    return _or_abort(comm, "head", lambda: run_head(comm, args), Path(cfg.run.dir))


def _or_abort(comm, who: str, body, run_dir: Path) -> int:
    """Run a rank's work; if it raises, say why in one line (it and the traceback go to files) and
    abort the whole job: the other ranks would otherwise wait for this one forever (under Slurm,
    until the allocation's time limit)."""
    try:
        return body()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - any failure must end the job, not hang it
        # the line also goes to run.dir: mpiexec may end before forwarding stderr
        line = failed_rank.record(run_dir, who, comm.Get_rank(), e)
        print(f"gyre: {line}", file=sys.stderr, flush=True)
        comm.Abort(1)
        return 1


def run_cell(args: argparse.Namespace) -> int:
    from gyre.cell.main import main as cell_main  # on cell ranks only: it loads torch and the trainer

    cfg = load_config(args.config, args.overrides)
    model = initial_model(cfg) or str(ensure_tiny_model(default_tiny_dir(cfg), cfg.model.tiny_family))
    argv = ["--run-dir", cfg.run.dir, "--model", model, "--engine-key-file", args.engine_key_file]
    if args.config:
        argv += ["--config", args.config]
    return cell_main(argv + list(args.overrides), place=cell_placement)


def run_head(comm, args: argparse.Namespace) -> int:
    from gyre import faults
    from gyre.head import Head  # on rank 0 only: a cell has no use for the head

    faults.hit("head", "start")

    cfg = load_config(args.config, args.overrides)
    n_cells = comm.Get_size() - 1
    if n_cells != cfg.sched.cells:
        print(f"gyre: the job has {n_cells} cell ranks but sched.cells = {cfg.sched.cells}; "
              f"start {cfg.sched.cells + 1} ranks or set sched.cells={n_cells}", file=sys.stderr)
        comm.Abort(2)

    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "head.pid").write_text(str(os.getpid()))  # for operators and fault tests
    # where the head runs (gyre status): the proxy, harnesses and logs live on this host
    (run_dir / "head.json").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))

    async def go() -> dict:
        loop = asyncio.get_running_loop()
        head: Head | None = None

        def deliver(msg) -> None:
            loop.call_soon_threadsafe(head.on_message, msg)

        link = HeadLink(comm, deliver).start()
        head = Head(cfg, link, n_cells, resume=args.resume, progress_bar=args.progress_bar,
                    engine_key=Path(args.engine_key_file).read_text().strip())
        try:
            return await head.run()
        finally:
            link.stop()

    report = asyncio.run(go())
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=1, default=str))
    if report.get("failed"):  # a task failed (e.g. a record could not be written): said on stderr already
        return 1
    return 130 if report.get("stopped") else 0


if __name__ == "__main__":
    sys.exit(main())  # an MPI rank leaves the normal way: see gyre/fast_exit.py
