"""Gyre on Slurm: the one place that reads a job's allocation, and `gyre submit` / `gyre status`.

A Gyre job is a heterogeneous Slurm job (``launchers/gyre.sbatch``):

* component 0, the head: 1 node (coordinator, proxy, harnesses, evaluators);
* component 1, the cells: ``sched.cells × sched.cell_nodes`` nodes with ``sched.gpus_per_node``
  GPUs each, cut into cells of consecutive nodes in Slurm's node order.

One heterogeneous ``srun`` step runs ``python -m gyre.cluster.main`` as one MPI world: rank 0 the
head on component 0, then one cell-agent rank per *cell*, placed on the first node of its cell's
block (``srun -w``). The other nodes of a block are allocated to the job (and so to the cell) and
are where a multi-node engine/trainer of that cell runs; the current cell agent runs its engine
and trainer processes on its own node only.

Everything about the allocation comes from Slurm's environment (``SLURM_HET_SIZE``,
``SLURM_JOB_NODELIST_HET_GROUP_0/1``, ``SLURM_GPUS_PER_NODE_HET_GROUP_1``, ``SLURM_RESTART_COUNT``,
``SLURM_PROCID``, ...) and is parsed here, with errors that say what is missing or what to change.

Entry points:

* ``python -m gyre.cluster.slurm prepare --config C [overrides]`` - run by the batch script before
  its step: checks the allocation against the configuration (fails at once, exit 2, with the fix),
  writes ``run.dir/slurm.json`` (job id, node blocks) and the engine key, and prints the shell
  variables the batch script's ``srun`` line uses;
* ``gyre submit`` (:func:`submit_add_arguments` / :func:`submit_run`);
* ``gyre status`` (:func:`status_add_arguments` / :func:`status_run`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gyre.cluster.local import engine_key_file
from gyre.config import ConfigError, GyreConfig, env, load_config
from gyre.fsio import atomic_write_text
from gyre.harness.runner import private_dir
from gyre.report import config_file

LOOPBACK = ("127.0.0.1", "localhost", "::1")
TEMPLATE = Path(__file__).resolve().parents[2] / "launchers" / "gyre.sbatch"
HEADER_END = "# ---- end of the #SBATCH header"


class SlurmEnvError(RuntimeError):
    """The job's Slurm environment is missing something, or does not fit the configuration."""


# ---- hostlists -----------------------------------------------------------------------------------
def expand_hostlist(spec: str) -> list[str]:
    """Slurm's compressed host list -> names, in order: ``head,node[01-03,07]`` -> head, node01..."""
    spec = spec.strip()
    if not spec:
        return []
    parts, depth, cur = [], 0, ""
    for ch in spec:  # split on commas outside brackets
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SlurmEnvError(f"bad host list {spec!r}: unbalanced ']'")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise SlurmEnvError(f"bad host list {spec!r}: unbalanced '['")
    parts.append(cur)
    out: list[str] = []
    for p in parts:
        if p:
            out.extend(_expand_one(p, spec))
    return out


def _expand_one(p: str, spec: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", p)
    if not m:
        return [p]
    head, tail = p[: m.start()], p[m.end():]
    names = []
    for rng in m.group(1).split(","):
        if "-" in rng:
            lo, hi = rng.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                raise SlurmEnvError(f"bad host list {spec!r}: range {rng!r}")
            names += [f"{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1)]
        elif rng.isdigit():
            names.append(rng)
        else:
            raise SlurmEnvError(f"bad host list {spec!r}: {rng!r}")
    return [x for n in names for x in _expand_one(head + n + tail, spec)]


# ---- the allocation ------------------------------------------------------------------------------
@dataclass
class Allocation:
    """What one heterogeneous Gyre job was given."""
    job_id: str
    het_size: int
    head_nodes: list[str]
    cell_nodes: list[str]
    gpus_per_node: int | None          # component 1, when the job asked with --gpus-per-node
    restart_count: int = 0
    submit_dir: str = ""
    partitions: list[str] = field(default_factory=list)


def _getter(environ: Mapping[str, str] | None):
    if environ is None:
        return env
    return lambda name, default=None: environ.get(name, default)


def allocation_from_env(environ: Mapping[str, str] | None = None) -> Allocation:
    """Read the batch script's Slurm environment (component 0's view of a het job)."""
    get = _getter(environ)
    job_id = get("SLURM_JOB_ID")
    if not job_id:
        raise SlurmEnvError("not inside a Slurm job (SLURM_JOB_ID is not set): submit with "
                            "`sbatch launchers/gyre.sbatch CONFIG` or `gyre submit --config CONFIG`; "
                            "on one machine use `gyre run`")
    het = get("SLURM_HET_SIZE")
    if not het:
        raise SlurmEnvError(f"job {job_id} is not a heterogeneous job (SLURM_HET_SIZE is not set): a Gyre job "
                            "has component 0 = the head (1 node) and component 1 = the cells; keep the "
                            "`#SBATCH hetjob` line of launchers/gyre.sbatch")
    try:
        het_size = int(het)
    except ValueError:
        raise SlurmEnvError(f"SLURM_HET_SIZE={het!r} is not a number") from None
    if het_size != 2:
        raise SlurmEnvError(f"job {job_id} has {het_size} het components; a Gyre job has exactly 2 "
                            "(head, cells)")
    lists = []
    for g in (0, 1):
        name = f"SLURM_JOB_NODELIST_HET_GROUP_{g}"
        value = get(name)
        if not value:
            raise SlurmEnvError(f"{name} is not set: cannot tell which nodes component {g} got "
                                "(Slurm >= 20.11 sets it in het batch scripts)")
        lists.append(expand_hostlist(value))
    gpus = get("SLURM_GPUS_PER_NODE_HET_GROUP_1")
    gpn = None
    if gpus:
        m = re.fullmatch(r"(?:[^:,]+:)?(\d+)", gpus.strip())  # "8" or "a100:8"
        if not m:
            raise SlurmEnvError(f"SLURM_GPUS_PER_NODE_HET_GROUP_1={gpus!r}: expected a count")
        gpn = int(m.group(1))
    try:
        restarts = int(get("SLURM_RESTART_COUNT") or 0)
    except ValueError:
        restarts = 0
    return Allocation(job_id=job_id, het_size=het_size, head_nodes=lists[0], cell_nodes=lists[1],
                      gpus_per_node=gpn, restart_count=restarts, submit_dir=get("SLURM_SUBMIT_DIR") or "",
                      partitions=[get(f"SLURM_JOB_PARTITION_HET_GROUP_{g}") or "" for g in (0, 1)])


@dataclass
class Rank:
    """One task's view of the step (``SLURM_PROCID`` etc.), for checks inside ``gyre.cluster.main``."""
    procid: int
    ntasks: int
    nodename: str


def rank_from_env(environ: Mapping[str, str] | None = None) -> Rank:
    get = _getter(environ)
    missing = [n for n in ("SLURM_PROCID", "SLURM_NTASKS") if get(n) is None]
    if missing:
        raise SlurmEnvError(f"{', '.join(missing)} not set: this process was not started by srun")
    return Rank(int(get("SLURM_PROCID")), int(get("SLURM_NTASKS")), get("SLURMD_NODENAME") or "")


def cell_blocks(alloc: Allocation, cfg: GyreConfig) -> list[list[str]]:
    """Cut component 1 into ``sched.cells`` blocks of ``sched.cell_nodes`` consecutive nodes, or
    say exactly what to change."""
    cells, size = cfg.sched.cells, cfg.sched.cell_nodes
    want, have = cells * size, len(alloc.cell_nodes)
    if len(alloc.head_nodes) != 1:
        raise SlurmEnvError(f"component 0 (the head) has {len(alloc.head_nodes)} nodes "
                            f"({','.join(alloc.head_nodes)}); it must be 1 node: `#SBATCH --nodes=1` before `hetjob`")
    if have != want:
        fixes = [f"submit component 1 with --nodes={want} (sched.cells={cells} × sched.cell_nodes={size})"]
        divisors = [d for d in range(1, have + 1) if have % d == 0]
        if size in divisors:
            fixes.append(f"set sched.cells={have // size}")
        alt = [f"sched.cells={have // d} sched.cell_nodes={d}" for d in divisors if d != size][:3]
        if alt:
            fixes.append("or use " + " / ".join(alt))
        raise SlurmEnvError(
            f"the allocation does not match the configuration: component 1 (the cells) has {have} nodes "
            f"({','.join(alloc.cell_nodes)}) but sched.cells={cells} × sched.cell_nodes={size} needs {want}. "
            f"Fix: {'; '.join(fixes)}")
    if alloc.gpus_per_node is not None and alloc.gpus_per_node != cfg.sched.gpus_per_node:
        raise SlurmEnvError(
            f"the allocation does not match the configuration: component 1 has {alloc.gpus_per_node} GPUs per node "
            f"but sched.gpus_per_node={cfg.sched.gpus_per_node}. Fix: submit with "
            f"--gpus-per-node={cfg.sched.gpus_per_node} or set sched.gpus_per_node={alloc.gpus_per_node}")
    return [alloc.cell_nodes[i * size:(i + 1) * size] for i in range(cells)]


# ---- prepare: run by the batch script --------------------------------------------------------------
JOB_MODULES = ("mpi4py", "torch", "gyre")


def check_job_python(modules: tuple[str, ...] = JOB_MODULES, python: str | None = None) -> None:
    """The job's Python must import what every rank imports, or each rank dies with a traceback
    after the allocation looked fine. Raises SlurmEnvError saying how to fix it."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise SlurmEnvError(f"the job's Python ({python or sys.executable}) cannot import {', '.join(missing)}: "
                            "submit from the shell where Gyre's virtualenv is active (sbatch exports PATH), or "
                            "set GYRE_PYTHON=/path/to/venv/bin/python")


def prepare(config: str | None, overrides: list[str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Check the allocation, write ``slurm.json`` and the engine key; return the batch script's variables."""
    get = _getter(environ)
    check_job_python()
    alloc = allocation_from_env(environ)
    cfg = load_config(config, overrides)
    blocks = cell_blocks(alloc, cfg)
    run_dir = Path(cfg.run.dir)
    if not run_dir.is_absolute():
        run_dir = Path(alloc.submit_dir or ".") / run_dir
    private_dir(run_dir)
    resume = (run_dir / "state.json").exists()
    if resume and alloc.restart_count == 0 and (get("GYRE_RESUME") or "") not in ("1", "yes", "true"):
        raise SlurmEnvError(f"{run_dir} holds a run (state.json): submit with GYRE_RESUME=1 to continue it, "
                            "or choose another run.dir")
    resolved = None
    if resume and config_file.stored(run_dir):  # the run's own configuration: nothing to retype on resume or
        # requeue; a --config only where it changes keys that may change (else refused, naming them)
        cfg, resolved = config_file.resumed(run_dir, config, overrides)
        blocks = cell_blocks(alloc, cfg)
    extra = []
    if cfg.engine.host in LOOPBACK:  # the head must reach each cell's engine across nodes
        extra.append("engine.host=0.0.0.0")
    (run_dir / "head.pid").unlink(missing_ok=True)  # never signal a previous attempt's pid
    report = run_dir / "report.json"
    report.unlink(missing_ok=True)
    key = engine_key_file(run_dir)
    record = {"job_id": alloc.job_id, "restart_count": alloc.restart_count, "at": time.time(),
              "head": alloc.head_nodes[0], "cells": [{"cell": i, "nodes": b, "rank_node": b[0]} for i, b in enumerate(blocks)],
              "gpus_per_node": alloc.gpus_per_node, "partitions": alloc.partitions, "resume": resume}
    atomic_write_text(run_dir / "slurm.json", json.dumps(record, indent=1), mode=0o644)
    gpus = alloc.gpus_per_node if alloc.gpus_per_node is not None else 0
    return {
        "GYRE_RUN_DIR": str(run_dir),
        "GYRE_N_CELLS": str(len(blocks)),
        "GYRE_CELL_NODES": ",".join(b[0] for b in blocks),
        "GYRE_HEAD_NODE": alloc.head_nodes[0],
        "GYRE_GPUS_PER_NODE": str(gpus),
        "GYRE_KEY_FILE": str(key),
        "GYRE_REPORT": str(report),
        "GYRE_RESUME_FLAG": "--resume" if resume else "",
        "GYRE_EXTRA_OVERRIDES": " ".join(extra),
        "GYRE_STEPS": str(cfg.run.steps),
        "GYRE_RESOLVED_CONFIG": str(resolved or ""),
    }


def _prepare_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m gyre.cluster.slurm prepare")
    p.add_argument("--config")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    try:
        out = prepare(a.config, a.overrides)
    except (SlurmEnvError, ConfigError) as e:
        print(f"gyre: {e}", file=sys.stderr)
        return 2
    for k, v in out.items():
        print(f"{k}={shlex.quote(v)}")
    return 0


# ---- gyre submit ------------------------------------------------------------------------------------
def submit_add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML configuration file (with --resume: the run's stored config.toml "
                                     "when omitted; run.dir=DIR names the run)")
    p.add_argument("--head-partition", default=None, help="partition of component 0 (the head)")
    p.add_argument("--cell-partition", default=None, help="partition of component 1 (the cells)")
    p.add_argument("--head-cpus", type=int, default=None, help="CPUs of the head task (harnesses, evaluators)")
    p.add_argument("--time", default=None, help="time limit, Slurm format (e.g. 24:00:00)")
    p.add_argument("--signal-lead", type=int, default=None,
                   help="seconds before the end at which the job stops, checkpoints and requeues (USR1)")
    p.add_argument("--mpi", default=None, help="srun --mpi plugin (pmi2 for the PyPI MPICH; pmix for OpenMPI)")
    p.add_argument("--no-requeue", action="store_true", help="do not requeue on USR1 / preemption")
    p.add_argument("--job-name", default=None)
    p.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                   help="extra sbatch option for the whole job's first component (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue the run in run.dir (GYRE_RESUME=1)")
    p.add_argument("--dry-run", action="store_true", help="write the script and print it; do not submit")
    p.add_argument("overrides", nargs="*", help="section.key=value configuration overrides")


def _template_parts() -> tuple[dict[str, str], str]:
    """Defaults of the shipped launcher (from its `# knob:` lines) and its body after the header."""
    text = TEMPLATE.read_text()
    if HEADER_END not in text:
        raise SystemExit(f"gyre submit: {TEMPLATE} has no '{HEADER_END}' line")
    head, body = text.split(HEADER_END, 1)
    defaults = dict(re.findall(r"^# knob: (\w+)=(\S*)", head, flags=re.M))
    return defaults, body.split("\n", 1)[1]


def render_sbatch(cfg: GyreConfig, args: argparse.Namespace) -> str:
    """The same het job as launchers/gyre.sbatch, with its header set from the config and options."""
    d, body = _template_parts()
    head_part = args.head_partition or d.get("HEAD_PARTITION", "head")
    cell_part = args.cell_partition or d.get("CELL_PARTITION", "cells")
    tlimit = args.time or d.get("TIME", "24:00:00")
    lead = args.signal_lead if args.signal_lead is not None else int(d.get("SIGNAL_LEAD", "300"))
    cpus = args.head_cpus or int(d.get("HEAD_CPUS", "4"))
    name = args.job_name or cfg.run.name
    nodes = cfg.sched.cells * cfg.sched.cell_nodes
    lines = ["#!/bin/bash",
             f"# written by `gyre submit` from {TEMPLATE} (config {args.config})",
             f"#SBATCH --job-name={name}",
             f"#SBATCH --chdir={Path.cwd()}",
             f"#SBATCH --time={tlimit}",
             f"#SBATCH --signal=B:USR1@{lead}",
             "#SBATCH --requeue" if not args.no_requeue else "#SBATCH --no-requeue",
             "#SBATCH --open-mode=append",
             f"#SBATCH --output={Path(cfg.run.dir).resolve()}/gyre-%j.out",  # the launcher's name, in the run dir
             f"#SBATCH --partition={head_part} --nodes=1 --ntasks=1 --cpus-per-task={cpus}"]
    lines += [f"#SBATCH {a}" for a in args.sbatch_arg]
    lines += ["#SBATCH hetjob",
              f"#SBATCH --partition={cell_part} --nodes={nodes} --ntasks-per-node=1 --time={tlimit}"
              + (f" --gpus-per-node={cfg.sched.gpus_per_node}" if cfg.sched.gpus_per_node else ""),
              HEADER_END + " (written by gyre submit) ----"]
    env_lines = [f"export GYRE_PYTHON=${{GYRE_PYTHON:-{shlex.quote(sys.executable)}}}"]
    if args.mpi:
        env_lines.append(f"export GYRE_MPI={shlex.quote(args.mpi)}")
    if args.no_requeue:
        env_lines.append("export GYRE_REQUEUE=0")
    return "\n".join(lines + env_lines) + "\n" + body


def submit_run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    if args.resume and config_file.stored(Path(cfg.run.dir)):  # the run's own configuration, overrides on top
        args.config = str(config_file.stored(Path(cfg.run.dir)).resolve())
        cfg = load_config(args.config, args.overrides)
    elif not args.config:
        raise SystemExit("gyre submit: --config FILE is needed (only --resume of a run that stored its "
                         "config.toml can do without)")
    run_dir = private_dir(Path(cfg.run.dir).resolve())
    if (run_dir / "state.json").exists() and not args.resume:
        raise SystemExit(f"gyre submit: {run_dir} holds a run; pass --resume to continue it or choose another run.dir")
    script = run_dir / "gyre.sbatch"
    script.write_text(render_sbatch(cfg, args))
    config = str(Path(args.config).resolve())
    cmd = ["sbatch", "--parsable", str(script), config, *args.overrides]
    if args.dry_run:
        print(script.read_text())
        print("would run: " + " ".join(shlex.quote(c) for c in cmd))
        return 0
    if not shutil.which("sbatch"):
        raise SystemExit("gyre submit: no sbatch on PATH (run it on a Slurm login node)")
    child_env = None
    if args.resume:
        child_env = {**os.environ, "GYRE_RESUME": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=child_env)
    if r.returncode != 0:
        print(r.stderr.strip() or r.stdout.strip(), file=sys.stderr)
        return r.returncode
    job = r.stdout.strip().split(";")[0]
    (run_dir / "slurm.job").write_text(job + "\n")
    print(f"submitted job {job}: {script}; its output: {run_dir}/gyre-{job}.out; "
          f"follow it with `gyre status {run_dir}`")
    return 0


# ---- gyre status ------------------------------------------------------------------------------------
def status_add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the run directory (run.dir)")
    p.add_argument("--json", action="store_true", help="print the status as JSON")


def _jsonl(path: Path) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # a line being written
    return out


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


RUN_FILES = ("state.json", "steps.jsonl", "config.toml", "slurm.json", "report.json", "cells.json", "ledger.jsonl")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: it exists
        return True
    return True


def collect_status(run_dir: Path) -> dict:
    """Cells, roles and progress of a run, from the files the run wrote (no live query needed)."""
    slurm = _json(run_dir / "slurm.json") or {}
    head = _json(run_dir / "head.json") or {}
    stored = config_file.stored(run_dir)
    total = None
    if stored:
        try:
            total = load_config(stored).run.steps
        except ConfigError:
            pass
    state = _json(run_dir / "state.json") or {}
    report = _json(run_dir / "report.json")
    steps = _jsonl(run_dir / "steps.jsonl")
    ledger = _jsonl(run_dir / "ledger.jsonl")
    admitted = [r for r in ledger if r.get("admitted") is True]
    not_admitted = [r for r in ledger if r.get("admitted") is False]
    cells: dict[int, dict] = {}
    for c in slurm.get("cells", []):
        cells[c["cell"]] = {"cell": c["cell"], "nodes": c["nodes"], "hostname": c.get("rank_node", "")}
    live = _json(run_dir / "cells.json") or {}  # the head rewrites it as roles change
    for c in live.get("cells", []):
        row = cells.setdefault(c["cell"], {"cell": c["cell"]})
        row["hostname"] = c.get("hostname") or row.get("hostname", "")
        row["role"] = c.get("role", "")
        row["mb_in_flight"] = c.get("mb_in_flight")
    if report:
        for c in report.get("cells", []):
            row = cells.setdefault(c["cell"], {"cell": c["cell"]})
            row["hostname"] = c.get("hostname") or row.get("hostname", "")
            ivs = (report.get("intervals") or {}).get(str(c["cell"])) or (report.get("intervals") or {}).get(c["cell"]) or []
            row["role"] = ivs[-1][0] if ivs else ""
            row.update({k: c.get(k) for k in ("rollout_s", "train_s", "switching_s", "switches", "utilisation")})
    job = slurm.get("job_id") or ((run_dir / "slurm.job").read_text().strip() if (run_dir / "slurm.job").exists() else "")
    job_state = ""
    slurm_knows = None  # None: no Slurm to ask; False: asked and it knows nothing of the job
    if job and shutil.which("squeue"):
        try:
            r = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=10)
            job_state = ",".join(sorted(set(r.stdout.split()))) if r.returncode == 0 else ""
        except (OSError, subprocess.TimeoutExpired):
            pass
    if job and not job_state and shutil.which("sacct"):  # left the queue: how it ended (cancelled, ...)
        try:
            r = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job, "-o", "State"], capture_output=True,
                               text=True, timeout=10)
            states = [line.split()[0] for line in r.stdout.splitlines() if line.strip()] if r.returncode == 0 else []
            job_state = states[-1] if states else ""
            slurm_knows = bool(states)
        except (OSError, subprocess.TimeoutExpired):
            pass
    head_alive = None
    if not job and head.get("pid") and head.get("host") == socket.gethostname():  # gyre run on this machine
        head_alive = _alive(int(head["pid"]))
    eta = None
    if total and steps and not report:
        span = steps[-1].get("t_end") or 0.0  # seconds since this attempt's start: the pace of a resumed run is rough
        if span > 0:
            eta = span / len(steps) * max(total - len(steps), 0)
    return {"run_dir": str(run_dir), "job_id": job, "job_state": job_state or ("ended" if report else ""),
            "slurm_knows": slurm_knows, "head_alive": head_alive, "steps_total": total, "eta_s": eta,
            "restart_count": slurm.get("restart_count", 0), "head": head.get("host") or slurm.get("head", ""),
            "version": state.get("version", 0), "steps_done": len(steps),
            "last_step": steps[-1] if steps else None, "executions_trained": len(admitted),
            "executions_not_admitted": len(not_admitted), "resumes": sum(1 for r in ledger if r.get("resume")),
            "cells": [cells[k] for k in sorted(cells)],
            "finished": bool(report) and not report.get("stopped"), "stopped": bool(report and report.get("stopped")),
            "errors": (report or {}).get("errors", [])}


_ENDED_EARLY = ("CANCELLED", "FAILED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
RESUME_HINT = "resume: gyre submit --resume run.dir=RUN_DIR (the run's config.toml is reused)"


def run_state(st: dict) -> str:
    """What the run is, in words, with the command that continues it where there is one."""
    job = (st.get("job_state") or "").upper()
    if st["finished"]:
        return "finished"
    if job.startswith(_ENDED_EARLY):
        return f"job {job.split(',')[0].lower()} before the run finished; {RESUME_HINT}"
    if "REQUEUE" in job or (job == "PENDING" and st.get("restart_count")):
        return "requeued: it resumes from state.json when it starts again"
    if st["stopped"]:
        return f"stopped (resumable); {RESUME_HINT}"
    if job in ("RUNNING", "COMPLETING"):
        return "running"
    if job in ("PENDING", "CONFIGURING"):
        return "waiting for its allocation"
    if st.get("slurm_knows") is False:
        return f"ended: Slurm no longer knows job {st['job_id']} (cancelled or killed before the run finished); {RESUME_HINT}"
    if st.get("head_alive") is False:
        return ("cancelled or killed: its head process is gone and it wrote no report; resume with "
                f"gyre run --resume run.dir={st['run_dir']}")
    if st.get("head_alive"):
        return "running"
    return "not started yet, or running where this machine cannot see it (no Slurm job recorded)"


def status_run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"gyre status: {run_dir} is not a directory", file=sys.stderr)
        return 2
    if not any((run_dir / f).exists() for f in RUN_FILES):
        print(f"gyre status: {run_dir} is not a run directory (none of {', '.join(RUN_FILES)}); "
              f"pass the run's run.dir", file=sys.stderr)
        return 2
    st = collect_status(run_dir)
    if args.json:
        print(json.dumps(st, indent=1, default=str))
        return 0
    print(f"run {st['run_dir']}  job {st['job_id'] or '-'} {st['job_state'] or ''}  restarts {st['restart_count']}")
    last = st["last_step"] or {}
    total = st["steps_total"]
    print(f"steps done {st['steps_done']}" + (f"/{total}" if total else "") + f" (policy version {st['version']})"
          + (f", last reward {last.get('reward_mean'):.3f}" if last.get("reward_mean") is not None else "")
          + f"; executions trained {st['executions_trained']}, not admitted {st['executions_not_admitted']}"
          + (f"; resumed {st['resumes']}x" if st["resumes"] else ""))
    if st["eta_s"] is not None:
        from gyre.report.progress import duration

        print(f"ETA {duration(st['eta_s'])} at the pace of the steps so far")
    print(f"head on {st['head'] or '?'}")
    for c in st["cells"]:
        nodes = ",".join(c.get("nodes", []))
        extra = f"  role {c['role']}" if c.get("role") else ""
        if c.get("rollout_s") is not None:
            extra += f"  rollout {c['rollout_s']:.1f}s train {c['train_s']:.1f}s switches {c['switches']}"
        print(f"  cell {c['cell']}: rank on {c.get('hostname') or '?'}  nodes {nodes or '?'}{extra}")
    print(f"state: {run_state(st).replace('RUN_DIR', st['run_dir'])}")
    for e in st["errors"]:
        print(f"  error: {e}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "prepare":
        sys.exit(_prepare_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "check-python":  # on a cell node, from the batch script
        try:
            check_job_python()
        except SlurmEnvError as e:
            print(f"gyre: {e}", file=sys.stderr)
            sys.exit(2)
        sys.exit(0)
    print("usage: python -m gyre.cluster.slurm prepare --config FILE [section.key=value ...]", file=sys.stderr)
    sys.exit(2)


# ---- job steps a cell starts from inside the job ---------------------------------------------------
def cell_step_prefix(environ: Mapping[str, str] | None = None) -> list[str]:
    """The ``srun`` prefix for a step over a cell's nodes, run from a cell agent's task.

    The agents' step already holds the nodes, so the new step shares them (``--overlap``). In a
    heterogeneous job a step of component 1 must name the leader's job id plus ``--het-group=1``
    (the component's own id is refused: "Job not heterogeneous job leader"); measured on the dev
    cluster (Slurm 22.05).
    """
    get = _getter(environ)
    het = get("SLURM_HET_SIZE")
    leader = get("SLURM_JOB_ID_HET_GROUP_0") if het else None
    job = leader or get("SLURM_JOB_ID")
    if not job:
        raise SlurmEnvError("SLURM_JOB_ID not set: a cell step can only be started from inside the job")
    prefix = ["srun", "--overlap", "--mpi=none", f"--jobid={job}"]
    if het:
        prefix.append("--het-group=1")
    return prefix
