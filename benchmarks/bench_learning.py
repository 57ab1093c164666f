"""Learning parity, measured live: does E learn like A and C at matched staleness, and what do the
off-policy corrections and the burst order change? Every figure comes from `gyre run` jobs on the
`learnable` suite (launchers/demo.toml: the embedded tiny model, the answer agent, real proxy,
engines, trainers, evaluator and shards), one job per configuration and seed.

Configurations (at `--size full`, the default `make bench` runs: 3 seeds x 14 steps each):

- E, A, C at staleness 0 and 2 (`train.off_policy = auto`: tis, since these runs make one update
  per step, `train.minibatches_per_step = 1`, where the clip against pi_prox cannot act; live runs
  take more updates per step since this round, not yet measured here);
- E2 with each correction: none, tis, decoupled (E2_tis is E2's configuration: its runs are
  E2's runs, reported under both labels), and tis and decoupled with two updates per step
  (`E2_tis_mb2`, `E2_decoupled_mb2`: `train.minibatches_per_step = 2`, where the clip acts);
- E0 with `sched.steps_per_sync = 4` and `sched.burst_order` stream vs shuffle.

Written to benchmarks/results/learning.json (flat): `final_reward_{label}` (mean over seeds of the
run's mean reward in its last two steps) with `_ci95` (t interval over seeds; null with one seed)
and `_per_seed` (each seed's value), `clip_frac_{label}` (share of tokens the clip cut),
`parity_E{k}` (E's mean inside both A's and C's interval), `mismatch_k3_lag0` / `mismatch_k3_lag2`
(token-weighted k3 KL between trainer and engine log-probs at policy lag 0 / 2), `mismatch_abs_max_lag0`,
`replaced_zero_variance_share` (replaced groups / (replaced + trained) over every run),
`burst_order_effect` (final reward stream minus shuffle, paired by seed, with `_ci95`),
`duration_position_corr_{stream,shuffle}` (Pearson r of a trained execution's duration with the
position of its step in the round, 0..3, pooled over seeds; `duration_position_corr` = stream),
grad norms, per-step reward curves, and `size` / `seeds` / `steps` saying what actually ran.
One PNG of the reward curves: benchmarks/results/learning.png.

    python benchmarks/bench_learning.py                    # full size: 30 jobs like `make demo`
                                                           # (~2 min 45 s each on a quiet 2-core machine)
    python benchmarks/bench_learning.py --size reduced     # 10 jobs, 1 seed, 3 steps, G 8: ~6 min, a smoke
                                                           # run (no intervals; learning starts later)
    python benchmarks/bench_learning.py --keep             # keep run directories (printed)
    python benchmarks/bench_learning.py --work DIR         # run directories in DIR; a rerun with the same
                                                           # DIR reuses every finished job (resumable)
    python benchmarks/bench_learning.py --only E2_tis_mb2 E2_decoupled_mb2
                                                           # those labels only: their figures replace the
                                                           # ones in learning.json, the rest are kept

Jobs run seed-major (every configuration's seed 0, then seed 1, ...), so a run cut short still
has every configuration at the seeds it reached.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "results" / "learning.json"
PNG = REPO / "benchmarks" / "results" / "learning.png"
CONFIG = REPO / "launchers" / "demo.toml"
SIZES = {  # seeds, steps, group size G (demo: 16), groups per step Q
    "full": (3, 14, 16, 2),
    "reduced": (1, 3, 8, 2),
}
SCHEMES = {"E": ["sched.scheme=E"], "A": ["sched.scheme=A", "sched.rollout_cells_async=1"], "C": ["sched.scheme=C"]}
BURST = 4
# two-sided 95% t quantiles by degrees of freedom (no scipy for one table); past 10: normal
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def configs() -> dict[str, list[str]]:
    out = {}
    for k in (0, 2):
        for s, over in SCHEMES.items():
            out[f"{s}{k}"] = [*over, f"sched.staleness={k}"]
    for corr in ("none", "decoupled"):
        out[f"E2_{corr}"] = [*SCHEMES["E"], "sched.staleness=2", f"train.off_policy={corr}"]
    # two PPO-style updates per step (train.minibatches_per_step): the clip against pi_prox acts
    # (clip_frac > 0), the evidence `auto` needs to pick between tis and decoupled there
    for corr in ("tis", "decoupled"):
        out[f"E2_{corr}_mb2"] = [*SCHEMES["E"], "sched.staleness=2", f"train.off_policy={corr}",
                                 "train.minibatches_per_step=2"]
    for order in ("stream", "shuffle"):
        out[f"E0_b{BURST}_{order}"] = [*SCHEMES["E"], "sched.staleness=0", f"sched.steps_per_sync={BURST}",
                                       f"sched.burst_order={order}"]
    return out


# a label whose configuration is another's: reported from that one's runs, never run twice
ALIASES = {"E2_tis": "E2"}  # auto at staleness 2 is tis (one update per step)


def interval(xs: list[float]) -> list[float] | None:
    if len(xs) < 2:
        return None
    m, sd = statistics.fmean(xs), statistics.stdev(xs)
    h = T95.get(len(xs) - 1, 1.96) * sd / math.sqrt(len(xs))
    return [m - h, m + h]


def pearson(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 3 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    return sxy / math.sqrt(sum((x - mx) ** 2 for x in xs) * sum((y - my) ** 2 for y in ys))


def run_one(label: str, over: list[str], seed: int, size: tuple, run_dir: Path) -> dict:
    seeds, steps, g, q = size
    gyre = Path(sys.executable).parent / "gyre"
    cmd = [str(gyre), "run", "--config", str(CONFIG), "--no-plots", f"run.dir={run_dir}", f"run.seed={seed}",
           f"run.steps={steps}", f"harness.group_size={g}", f"harness.concurrency={2 * g}",
           f"run.groups_per_step={q}", "proxy.port=0", *over]
    t = time.perf_counter()
    with open(run_dir.parent / f"{label}-s{seed}.log", "w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, timeout=3600).returncode
    if rc != 0:
        raise RuntimeError(f"{label} seed {seed}: gyre run exited {rc}; see {run_dir.parent / f'{label}-s{seed}.log'}")
    rep = json.loads((run_dir / "report.json").read_text())
    rep["bench_wall_s"] = time.perf_counter() - t
    return rep


def durations(run_dir: Path, steps_per_sync: int) -> tuple[list[float], list[float]]:
    """(position of its step in the round, duration) of every trained execution."""
    from gyre.traj.store import iter_executions

    step_of = {}
    for line in (run_dir / "ledger.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("admitted"):
            step_of[row["execution"]] = row["step"]
    pos, dur = [], []
    for rec in iter_executions(run_dir / "shards"):
        if rec.execution_id in step_of:
            pos.append(float(step_of[rec.execution_id] % steps_per_sync))
            dur.append(rec.t_end - rec.t_start)
    return pos, dur


def final_reward(rep: dict) -> float | None:
    vals = [s["reward_mean"] for s in rep["steps"][-2:] if s["reward_mean"] is not None]
    return statistics.fmean(vals) if vals else None


def weighted(reps: list[dict], key: str, weight: str) -> float | None:
    num = den = 0.0
    for rep in reps:
        for s in rep["steps"]:
            if s.get(key) is not None and s.get(weight):
                num += s[key] * s[weight]
                den += s[weight]
    return num / den if den else None


def analyse(runs: dict[str, list[tuple[dict, Path]]], size_name: str, size: tuple) -> dict:
    seeds, steps, g, q = size
    out: dict = {"size": size_name, "seeds": seeds, "steps": steps, "group_size": g, "groups_per_step": q,
                 "suite": "learnable"}
    for label, items in runs.items():
        reps = [r for r, _ in items]
        finals = [f for f in map(final_reward, reps) if f is not None]
        out[f"final_reward_{label}"] = statistics.fmean(finals) if finals else None
        out[f"final_reward_{label}_ci95"] = interval(finals)
        out[f"final_reward_{label}_per_seed"] = [final_reward(r) for r in reps]  # seed order; None: no reward
        out[f"clip_frac_{label}"] = weighted(reps, "clip_frac", "micro_batches")
        out[f"grad_norm_mean_{label}"] = statistics.fmean(
            [s["grad_norm"] for r in reps for s in r["steps"] if s.get("grad_norm") is not None] or [math.nan])
        out[f"curve_{label}"] = [statistics.fmean(vals) if (vals := [r["steps"][i]["reward_mean"] for r in reps
                                                                    if i < len(r["steps"]) and r["steps"][i]["reward_mean"] is not None]) else None
                                 for i in range(steps)]
        out[f"wall_s_{label}"] = statistics.fmean(r["bench_wall_s"] for r in reps)
    for k in (0, 2):
        e, a, c = (out.get(f"final_reward_{s}{k}") for s in "EAC")
        ia, ic = out.get(f"final_reward_A{k}_ci95"), out.get(f"final_reward_C{k}_ci95")
        out[f"parity_E{k}"] = None if None in (e, ia, ic) else bool(ia[0] <= e <= ia[1] and ic[0] <= e <= ic[1])
    every = [r for label, items in runs.items() if label not in ALIASES for r, _ in items]
    out["mismatch_k3_lag0"] = weighted(every, "mismatch_k3_lag0", "mismatch_tokens_lag0")
    out["mismatch_abs_max_lag0"] = max((s["mismatch_abs_max_lag0"] for r in every for s in r["steps"]
                                        if s.get("mismatch_abs_max_lag0") is not None), default=None)
    out["mismatch_k3_lag2"] = weighted(every, "mismatch_k3_lag2", "mismatch_tokens_lag2")
    for corr in ("none", "tis", "decoupled", "tis_mb2", "decoupled_mb2"):
        reps = [r for r, _ in runs.get(f"E2_{corr}", [])]
        out[f"truncated_frac_E2_{corr}"] = weighted(reps, "truncated_frac", "micro_batches")
    replaced = sum(s.get("replaced_zero_variance", 0) for r in every for s in r["steps"])  # aliases not twice
    trained = sum(s["groups"] for r in every for s in r["steps"])
    out["replaced_zero_variance_share"] = replaced / (replaced + trained) if replaced + trained else None
    out["warnings"] = sorted({w for r in every for w in r.get("warnings", [])})
    # the burst order question
    by_seed = {}
    for order in ("stream", "shuffle"):
        items = runs.get(f"E0_b{BURST}_{order}", [])
        pos, dur = [], []
        for rep, run_dir in items:
            p, d = durations(run_dir, BURST)
            pos += p
            dur += d
            by_seed.setdefault(order, []).append(final_reward(rep))
        out[f"duration_position_corr_{order}"] = pearson(pos, dur)
    out["duration_position_corr"] = out.get("duration_position_corr_stream")
    diffs = [a - b for a, b in zip(by_seed.get("stream", []), by_seed.get("shuffle", [])) if None not in (a, b)]
    out["burst_order_effect"] = statistics.fmean(diffs) if diffs else None
    out["burst_order_effect_ci95"] = interval(diffs)
    return out


def plot(out: dict, labels: list[str], png: Path = PNG) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), sharey=True)
    groups = [("matched staleness", [f"{s}{k}" for k in (0, 2) for s in "EAC"]),
              ("E2 corrections", [f"E2_{c}" for c in ("none", "tis", "decoupled", "tis_mb2", "decoupled_mb2")]),
              (f"burst order (E0, {BURST} steps/sync)", [f"E0_b{BURST}_{o}" for o in ("stream", "shuffle")])]
    for ax, (title, names) in zip(axes, groups):
        for name in names:
            ys = out.get(f"curve_{name}")
            if ys:
                ax.plot(range(len(ys)), ys, marker="o", ms=3, label=name, ls="--" if name.endswith("2") else "-")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("mean reward of the step's executions")
    fig.suptitle(f"learnable suite, {out['seeds']} seed(s) x {out['steps']} steps ({out['size']} size)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="full")
    p.add_argument("--only", nargs="*", default=None, help="configuration labels to run (default: all)")
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    p.add_argument("--seeds", type=int, default=None,
                   help="seeds per configuration (default: the size's); with --work, a run cut short "
                        "is analysed over the seeds it finished")
    p.add_argument("--work", type=Path, default=None,
                   help="directory for the run directories, kept; finished jobs found there are reused")
    p.add_argument("--out", type=Path, default=OUT, help="results file (a .png of the curves beside it)")
    args = p.parse_args(argv)
    size = SIZES[args.size]
    if args.seeds is not None:
        size = (args.seeds, *size[1:])
    todo = {k: v for k, v in configs().items() if args.only is None or k in args.only}
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
        args.keep = True
    work = args.work or Path(tempfile.mkdtemp(prefix="gyre-learning-"))
    runs: dict[str, list[tuple[dict, Path]]] = {}
    try:
        for seed in range(size[0]):
            for label, over in todo.items():
                run_dir = work / f"{args.size}-{label}-s{seed}"
                done = run_dir / "bench.json"
                if done.exists():
                    rep = json.loads(done.read_text())
                else:
                    shutil.rmtree(run_dir, ignore_errors=True)  # a job cut short starts over
                    rep = run_one(label, over, seed, size, run_dir)
                    done.write_text(json.dumps(rep))
                runs.setdefault(label, []).append((rep, run_dir))
                print(f"{label} seed {seed}: final reward {final_reward(rep)}, {rep['bench_wall_s']:.0f} s", flush=True)
        for alias, label in ALIASES.items():
            if label in runs and (args.only is None or alias in args.only):
                runs[alias] = runs[label]
        out = analyse(runs, args.size, size)
    finally:
        if args.keep:
            print(f"run directories kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    if args.only is not None and args.out.exists():
        # a partial re-run (--only) replaces its labels' figures and keeps every other one: the
        # figures over all runs (mismatch, parity, burst order) are not recomputed from a subset
        old = json.loads(args.out.read_text())
        mine = {k: v for k, v in out.items() if any(k.endswith(f"_{label}") or f"_{label}_" in k for label in runs)}
        out = {**old, **mine, "rerun_labels": sorted(runs), "rerun_size": args.size}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    plot(out, list(todo), args.out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in out.items() if not k.startswith("curve_")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
