"""The optimisation terms under a real `gyre run`: learning-rate warmup and cosine decay, and the
KL penalty to the frozen reference, on the learnable suite (launchers/demo.toml with fewer steps:
the embedded tiny model, the answer agent, real proxy, engines, trainers, evaluator and shards).

What it records, from the run's own step rows (steps.jsonl, what every metrics stream gets):

- `lr_first`, `lr_last`: the learning rate of the first and last optimizer step (`learning_rate`
  of the rows: warmup starts at lr / lr_warmup_steps, cosine ends at train.min_lr);
- `lr_by_step`: every step's rate;
- `kl_ref_mean`: the mean over steps of `kl_ref_mean` (the k3 estimate of KL(pi_theta || pi_ref)
  per target token; 0 at step 0, where the policy is the reference), and `kl_ref_by_step`;
- `ref_memory_bytes`: what the reference costs each trainer rank (one float32 copy of the tiny
  model's parameters in the embedded trainer), `ref_time_fraction`: the reference forward's share
  of the trainers' forward-and-backward time, mean over steps;
- `reward_by_step`, `steps`, `wall_s`, and the overrides the run used.

Written to benchmarks/results/loop_opt.json (flat; the lead merges lr_first, lr_last and
kl_ref_mean into loop.json).

    python benchmarks/bench_loop_opt.py              # 6 steps, G 8 (a few minutes on 2 cores)
    python benchmarks/bench_loop_opt.py --steps 4 --group-size 4 --keep
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "results" / "loop_opt.json"
CONFIG = REPO / "launchers" / "demo.toml"


def overrides(steps: int, g: int) -> list[str]:
    return [f"run.steps={steps}", f"harness.group_size={g}", f"harness.concurrency={2 * g}", "proxy.port=0",
            "train.lr_schedule=cosine", "train.lr_warmup_steps=2", "train.min_lr=0.002",
            "train.kl_coef=0.05", "train.kl_estimator=k3"]


def mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--keep", action="store_true", help="keep the run directory (printed)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gyre-loop-opt-"))
    run_dir = work / "run"
    over = overrides(args.steps, args.group_size)
    cmd = [str(Path(sys.executable).parent / "gyre"), "run", "--config", str(CONFIG), "--no-plots",
           f"run.dir={run_dir}", *over]
    t0 = time.perf_counter()
    log = work / "run.log"
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, timeout=3600).returncode
    wall = time.perf_counter() - t0
    if rc != 0:
        print(log.read_text()[-4000:])
        raise SystemExit(f"gyre run exited {rc}; run directory kept: {work}")
    rows = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: r["step"])
    lrs = [r.get("learning_rate") for r in rows]
    kls = [r.get("kl_ref_mean") for r in rows]
    out = {
        "lr_first": lrs[0], "lr_last": lrs[-1], "lr_by_step": lrs,
        "kl_ref_mean": mean(kls), "kl_ref_first": kls[0], "kl_ref_last": kls[-1], "kl_ref_by_step": kls,
        "ref_memory_bytes": max((r.get("ref_memory_bytes") or 0 for r in rows), default=None),
        "ref_time_fraction": mean([r.get("ref_time_fraction") for r in rows]),
        "entropy_by_step": [r.get("entropy") for r in rows],
        "reward_by_step": [r.get("reward_mean") for r in rows],
        "steps": len(rows), "group_size": args.group_size, "wall_s": round(wall, 1),
        "overrides": over, "config": str(CONFIG.relative_to(REPO)),
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if not k.endswith("_by_step")}, indent=1))
    if args.keep:
        print(f"run directory: {run_dir}")
    else:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
