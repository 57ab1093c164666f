"""The demo job through `sbatch launchers/gyre.sbatch` on the dev cluster (slurm/devcluster.sh),
beside the same job through `gyre run` (mpiexec on one machine), in one run:

- job start to first rollout request: from submission (sbatch / `gyre run` start) to the first
  model call recorded in the shards;
- per-switch control path: median head round trip of each direction, weight bytes excluded.

Needs root, network namespaces and the Slurm packages (see slurm/README.md). Writes
benchmarks/results/slurm.json.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gyre.traj.store import iter_executions  # noqa: E402

STATE = os.environ.get("GYRE_SLURM_DIR", "/tmp/gyre-devcluster")
JOB = ["run.steps=2", "harness.group_size=4", "sched.cells=2", "sched.cell_nodes=4", "sched.gpus_per_node=8",
       "sched.execs_per_cell=3"]


def first_call(run_dir: Path) -> float:
    return min(c.t_start for rec in iter_executions(run_dir / "shards") for c in rec.tree.calls)


def switch_ms(report: dict, to: str) -> float | None:
    xs = [1e3 * (p["wall_s"] - p.get("load", 0.0)) for c in report["cells"] for p in c["switch_phases"]
          if p["to"] == to and p["ok"]]
    return statistics.median(xs) if xs else None


def via_slurm(tmp: Path, env: dict) -> dict:
    run_dir = tmp / "slurm"
    t0 = time.time()
    job = subprocess.run(["sbatch", "--parsable", str(ROOT / "launchers" / "gyre.sbatch"), str(ROOT / "launchers" / "demo.toml"),
                          f"run.dir={run_dir}", *JOB], env=env, capture_output=True, text=True, check=True,
                         cwd=tmp).stdout.strip().split(";")[0]
    deadline = time.time() + 600
    while time.time() < deadline:
        q = subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True, text=True)
        if not q.stdout.strip():
            break
        time.sleep(1)
    else:
        subprocess.run(["scancel", job], env=env)
        raise SystemExit(f"job {job} did not finish in 600 s")
    rep = json.loads((run_dir / "report.json").read_text())
    return {"submit_to_first_call_s": first_call(run_dir) - t0, "wall_s": time.time() - t0,
            "switch_r2t_ms": switch_ms(rep, "train"), "switch_t2r_ms": switch_ms(rep, "rollout"),
            "hostnames": sorted({c["hostname"] for c in rep["cells"]}), "steps": len(rep["steps"])}


def via_mpiexec(tmp: Path) -> dict:
    run_dir = tmp / "local"
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "gyre.cli", "run", "--config", str(ROOT / "launchers" / "demo.toml"),
                    "--no-plots", f"run.dir={run_dir}", *JOB], check=True, capture_output=True, cwd=ROOT)
    rep = json.loads((run_dir / "report.json").read_text())
    return {"submit_to_first_call_s": first_call(run_dir) - t0, "wall_s": time.time() - t0,
            "switch_r2t_ms": switch_ms(rep, "train"), "switch_t2r_ms": switch_ms(rep, "rollout"),
            "steps": len(rep["steps"])}


def main() -> dict:
    env = dict(os.environ, SLURM_CONF=f"{STATE}/slurm.conf", GYRE_PYTHON=sys.executable,
               PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    devcluster = str(ROOT / "slurm" / "devcluster.sh")
    t = time.time()
    subprocess.run([devcluster, "up"], env=env, check=True, capture_output=True, timeout=120)
    bring_up = time.time() - t
    try:
        with tempfile.TemporaryDirectory() as d:
            os.chmod(d, 0o755)  # slurmd's namespaces run jobs as root too, but keep it readable
            slurm = via_slurm(Path(d), env)
            local = via_mpiexec(Path(d))
    finally:
        subprocess.run([devcluster, "down"], env=env, capture_output=True, timeout=120)
    out = {"devcluster_up_s": bring_up, "cells": 2, "cell_nodes": 4, "steps": 2}
    out.update({f"slurm_{k}": v for k, v in slurm.items()})
    out.update({f"mpiexec_{k}": v for k, v in local.items()})
    return out


if __name__ == "__main__":
    import shutil

    if os.geteuid() != 0 or not shutil.which("sbatch") or not shutil.which("slurmctld"):
        print("bench_slurm: skipped (needs root and the Slurm packages: see slurm/README.md)")
        sys.exit(0)
    res = main()
    path = ROOT / "benchmarks" / "results" / "slurm.json"
    path.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
