"""`gyre run`: the whole job on one machine, as the same MPI processes it runs on a cluster.

Rank 0 is the head, ranks 1..N the cell agents (`gyre.cluster.main`), started with `mpiexec`
(the one next to this Python first: `pip install mpich` puts it there; a site's own otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from gyre.cell.mpi_link import one_machine_env
from gyre.cluster import failed_rank
from gyre.cluster.preflight import preflight
from gyre.config import load_config
from gyre.engine.reaper import reap
from gyre.harness.execute import load_tasks
from gyre.harness.runner import private_dir
from gyre.report import config_file
from gyre.report.live import gantt, print_report, reward_curve


def find_mpiexec() -> str:
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    found = shutil.which("mpiexec")
    if not found:
        raise SystemExit("gyre run: no mpiexec found; `pip install mpich` (or load your site's MPI module)")
    return found


def engine_key_file(run_dir: Path) -> Path:
    """The job's engine secret, private to the user; kept across --resume."""
    path = run_dir / "engine.key"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32))
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML configuration file")
    p.add_argument("--resume", action="store_true", help="continue the run in run.dir from its last step")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--strict", action="store_true",
                   help="refuse a suite with a broken task folder (harness.strict_suite = true)")
    p.add_argument("overrides", nargs="*", help="section.key=value configuration overrides")


def launch_command(args: argparse.Namespace, cells: int, key: Path, report: Path) -> list[str]:
    cmd = [find_mpiexec(), "-n", str(cells + 1), sys.executable, "-m", "gyre.cluster.main",
           "--engine-key-file", str(key), "--report", str(report)]
    if args.config:
        cmd += ["--config", args.config]
    if args.resume:
        cmd.append("--resume")
    if sys.stdout.isatty():  # the head's output reaches us through mpiexec, no longer a terminal there
        cmd.append("--progress-bar")
    return cmd + list(args.overrides)


def run(args: argparse.Namespace) -> int:
    if args.strict:
        args.overrides = [*args.overrides, "harness.strict_suite=true"]
    cfg = load_config(args.config, args.overrides)
    if args.resume:  # the run's own configuration, overrides on top; a --config only where it may change
        cfg, args.config = config_file.resumed(cfg.run.dir, args.config, args.overrides)
    load_tasks(cfg)  # a bad suite is a clear message here, not a traceback from the head rank
    preflight(cfg)  # so is a wrong model.path or harness program: nothing is launched
    run_dir = private_dir(Path(cfg.run.dir))
    if not args.resume and (run_dir / "state.json").exists():
        raise SystemExit(f"gyre run: {run_dir} holds a run; pass --resume to continue it or choose another run.dir")
    if args.resume:  # engines, trainers and key files a killed job left behind go first
        gone = reap(run_dir)
        if gone["processes"] or gone["key_files"]:
            print(f"gyre run: reaped {len(gone['processes'])} processes and {len(gone['key_files'])} key files "
                  f"of the killed run", file=sys.stderr)
    report_path = run_dir / "report.json"
    report_path.unlink(missing_ok=True)
    started = time.time()
    proc = subprocess.Popen(launch_command(args, cfg.sched.cells, engine_key_file(run_dir), report_path),
                            env=one_machine_env())

    def forward(signum, _frame):  # the head stops harnesses and writes what it recorded
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if not report_path.exists():
        said = failed_rank.since(run_dir, started)  # also when mpiexec ended before forwarding them
        print(f"gyre run: the job ended (exit {rc}) without a report; "
              + ("; ".join(said) if said else "see the messages above"), file=sys.stderr)
        return rc or 1
    report = json.loads(report_path.read_text())
    print_report(report)
    if not args.no_plots:
        print(f"wrote {gantt(report, run_dir / 'gantt.png')} and {reward_curve(report, run_dir / 'reward.png')}")
    return rc
