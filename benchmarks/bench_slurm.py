"""The demo job through `sbatch launchers/gyre.sbatch` on the dev cluster (slurm/devcluster.sh),
beside the same job through `gyre run` (mpiexec on one machine), in one run:

- job start to first rollout request: from submission (sbatch / `gyre run` start) to the first
  model call recorded in the shards;
- per-switch control path: median head round trip of each direction, weight bytes excluded;
- cells (2 cells x 2 nodes): nodes holding trainer ranks / the engine per cell (from what the
  ranks report), the time to form a cross-cell reduce group, and whether the reduce over
  2 cells x 2 ranks equals one process on the same micro-batches (tests/mpi_scripts/cell_head.py
  as a heterogeneous step);
- weight sync: parallel export (one piece per trainer rank) + the engine's
  /update_weights_from_disk, in bytes/s, over this machine's raw write+fsync+read of the same bytes.

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
JOB = ["run.steps=2", "harness.group_size=4", "sched.cells=2", "sched.cell_nodes=2", "sched.gpus_per_node=8",
       "sched.execs_per_cell=3"]
NODES = [["node01", "node02"], ["node03", "node04"]]


def first_call(run_dir: Path) -> float:
    return min(c.t_start for rec in iter_executions(run_dir / "shards") for c in rec.tree.calls)


def switch_ms(report: dict, to: str) -> float | None:
    xs = [1e3 * (p["wall_s"] - p.get("load", 0.0)) for c in report["cells"] for p in c["switch_phases"]
          if p["to"] == to and p["ok"]]
    return statistics.median(xs) if xs else None


def via_slurm(tmp: Path, env: dict) -> dict:
    run_dir = tmp / "slurm"
    t0 = time.time()
    script = tmp / "gyre4.sbatch"  # component 1 = 2 cells x 2 nodes
    script.write_text((ROOT / "launchers" / "gyre.sbatch").read_text().replace("--nodes=8", "--nodes=4"))
    job = subprocess.run(["sbatch", "--parsable", str(script), str(ROOT / "launchers" / "demo.toml"),
                          f"run.dir={run_dir}", *JOB], env=env, capture_output=True, text=True, check=True,
                         cwd=tmp).stdout.strip().split(";")[0]
    wait_job(job, env)
    rep = json.loads((run_dir / "report.json").read_text())
    cells = [json.loads((run_dir / "cells" / f"cell{i}.json").read_text()) for i in range(2)]
    return {"submit_to_first_call_s": first_call(run_dir) - t0, "wall_s": time.time() - t0,
            "switch_r2t_ms": switch_ms(rep, "train"), "switch_t2r_ms": switch_ms(rep, "rollout"),
            "hostnames": sorted({c["hostname"] for c in rep["cells"]}), "steps": len(rep["steps"]),
            "trainer_nodes_per_cell": min(len(set(c["trainer_hosts"])) for c in cells),
            "engine_nodes_per_cell": min(len(set(c["engine_nodes"])) for c in cells)}


def wait_job(job: str, env: dict, bound_s: float = 600) -> None:
    deadline = time.time() + bound_s
    while time.time() < deadline:
        q = subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True, text=True)
        if not q.stdout.strip():
            return
        time.sleep(1)
    subprocess.run(["scancel", job], env=env)
    raise SystemExit(f"job {job} did not finish in {bound_s:.0f} s")


def cell_scenario(tmp: Path, env: dict) -> dict:
    """tests/mpi_scripts/cell_head.py on 1 head + 2 cells x 2 nodes: group formation, reduce vs one process."""
    from gyre.model.tiny import ensure_tiny_model

    run = tmp / "cells"
    run.mkdir(mode=0o700)
    (run / "slurm.json").write_text(json.dumps({"cells": [{"cell": i, "nodes": n} for i, n in enumerate(NODES)]}))
    model, key, out = ensure_tiny_model(tmp / "tiny"), tmp / "cells.key", tmp / "cells.json"
    key.write_text("bench-key")
    key.chmod(0o600)
    args = f"{ROOT}/tests/mpi_scripts/cell_head.py {run} {model} {key} {out}"
    script = tmp / "cells.sbatch"
    script.write_text(f"""#!/bin/bash
#SBATCH --partition=head --nodes=1 --ntasks=1
#SBATCH hetjob
#SBATCH --partition=cells --nodes=4 --ntasks-per-node=1
cd {ROOT}
export PYTHONPATH={ROOT}
srun --mpi=pmi2 --kill-on-bad-exit=1 --het-group=0 -N1 -n1 {sys.executable} {args} : \\
     --het-group=1 -N2 -n2 --ntasks-per-node=1 -w {NODES[0][0]},{NODES[1][0]} {sys.executable} {args}
""")
    job = subprocess.run(["sbatch", "--parsable", "-o", str(tmp / "cells.out"), str(script)], env=env,
                         capture_output=True, text=True, check=True).stdout.strip().split(";")[0]
    wait_job(job, env)
    d = json.loads(out.read_text())
    if "error" in d:
        raise SystemExit(f"cell scenario failed: {d['error']}")
    return {"dp_group_form_ms": max(r["info"]["group_form_ms"] for r in d["reduce_step0"]),
            "reduce_matches_single": max(d["checks"][k] for k in ("v1_max_diff", "v2_max_diff", "v3_max_diff")) <= 1e-6,
            "reduce_max_abs_diff": max(d["checks"][k] for k in ("v1_max_diff", "v2_max_diff", "v3_max_diff")),
            "trainer_hosts": {c: h["trainer_hosts"] for c, h in d["hello"].items()},
            "cell_nodes": len(NODES[0]),
            "trainer_nodes_per_cell": min(len(set(h["trainer_hosts"])) for h in d["hello"].values()),
            "engine_nodes_per_cell": min(len(set(h["engine_nodes"])) for h in d["hello"].values())}


def weight_sync(tmp: Path, ranks: int = 2) -> dict:
    """Export (``ranks`` pieces in parallel) + engine load over raw write+fsync+read of the same bytes."""
    import shutil

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from gyre.config import load_config
    from gyre.engine.launch import start_cell_engine
    from gyre.engine.sglang_api import SGLangAdmin
    from gyre.model.identity import write_identity
    from gyre.model.tiny import ensure_tiny_model
    from gyre.cell.trainer_process import TrainerProcess

    tiny = ensure_tiny_model(tmp / "tiny")
    model = tmp / "wide"  # the tiny model's tokenizer, a wider random body: ~64 MB of float32
    cfg_hf = Qwen2Config.from_pretrained(str(tiny))
    cfg_hf.hidden_size, cfg_hf.intermediate_size, cfg_hf.num_hidden_layers = 512, 1536, 4
    cfg_hf.num_attention_heads, cfg_hf.num_key_value_heads = 8, 4
    cfg_hf.layer_types = ["full_attention"] * cfg_hf.num_hidden_layers
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg_hf).to(torch.float32).save_pretrained(model)
    shutil.copyfile(tiny / "tokenizer.json", model / "tokenizer.json")
    write_identity(model, "bench-wide")
    cfg = load_config(None, ["train.dtype=float32"])
    engine = start_cell_engine(cfg, model, api_key="bench", extra_args=["--weight-version", "0"])
    trainer = TrainerProcess(cfg.train, model, ranks=ranks, timeout_s=600)
    try:
        trainer.wait_ready()
        admin = SGLangAdmin(engine.url, "bench", timeout_s=600)
        export_s, load_s = [], []
        for v in range(1, 4):
            out = tmp / "weights" / f"v{v}"
            t = time.perf_counter()
            trainer.export_weights(out, v)
            export_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            admin.update_weights_from_disk(str(out), str(v))
            load_s.append(time.perf_counter() - t)
        nbytes = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    finally:
        trainer.close()
        engine.stop()
    raw_s = []
    blob = os.urandom(nbytes)
    for i in range(3):  # the same bytes, one file, written, fsynced, read back
        path = tmp / f"raw{i}.bin"
        t = time.perf_counter()
        with open(path, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        with open(path, "rb") as f:
            f.read()
        raw_s.append(time.perf_counter() - t)
        path.unlink()
    sync_s = statistics.median(e + ld for e, ld in zip(export_s, load_s))
    raw = statistics.median(raw_s)
    return {"weight_bytes": nbytes, "weight_export_s": statistics.median(export_s),
            "weight_load_s": statistics.median(load_s), "weight_raw_write_read_s": raw,
            "weight_sync_MBps": nbytes / sync_s / 1e6, "weight_raw_MBps": nbytes / raw / 1e6,
            "weight_sync_ratio": raw / sync_s, "weight_export_ranks": ranks}


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
            cells = cell_scenario(Path(d), env)
            local = via_mpiexec(Path(d))
            sync = weight_sync(Path(d))
    finally:
        subprocess.run([devcluster, "down"], env=env, capture_output=True, timeout=120)
    out = {"devcluster_up_s": bring_up, "cells": 2, "steps": 2, **cells, **sync,
           "trainer_nodes_per_cell": slurm.pop("trainer_nodes_per_cell"),
           "engine_nodes_per_cell": slurm.pop("engine_nodes_per_cell")}
    out.update({f"slurm_{k}": v for k, v in slurm.items()})
    out.update({f"mpiexec_{k}": v for k, v in local.items()})
    return out


if __name__ == "__main__":
    import argparse
    import shutil

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("weight_sync", "cells"), help="re-measure one part, keeping the others' figures")
    only = p.parse_args().only
    path = ROOT / "benchmarks" / "results" / "slurm.json"
    if only == "weight_sync":  # no Slurm needed: the shared filesystem of this machine
        with tempfile.TemporaryDirectory() as d:
            res = {**(json.loads(path.read_text()) if path.exists() else {}), **weight_sync(Path(d))}
    elif only == "cells":  # the cell scenario on the dev cluster only
        env = dict(os.environ, SLURM_CONF=f"{STATE}/slurm.conf", GYRE_PYTHON=sys.executable,
                   PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
        subprocess.run([str(ROOT / "slurm" / "devcluster.sh"), "up"], env=env, check=True, capture_output=True, timeout=120)
        with tempfile.TemporaryDirectory() as d:
            os.chmod(d, 0o755)
            res = {**(json.loads(path.read_text()) if path.exists() else {}), **cell_scenario(Path(d), env)}
    else:
        if os.geteuid() != 0 or not shutil.which("sbatch") or not shutil.which("slurmctld"):
            print("bench_slurm: skipped (needs root and the Slurm packages: see slurm/README.md)")
            sys.exit(0)
        res = main()
    path.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
