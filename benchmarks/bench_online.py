"""Online benchmark: the live loop (`gyre run`) on this machine, per scheme, and against the simulator.

- Per scheme (E, A, C on the same workload, seed and staleness): wall_s, idle and switching
  fractions (sum over cells of idle_s / switching_s over the sum of wall_s), utilisation, switches.
- Switch control path per direction from the E run's switch_phases: ``switch_r2t_ms`` and
  ``switch_t2r_ms`` = median head round trip without the weight-bytes ("load") phase, plus the
  agent-side phase medians (drain, release, restore; stash, offload, resume). Goal < 100 ms.
- ``head_rss_mb_step5``, ``head_rss_mb_step40``, ``head_rss_growth`` (goal < 10%): the head's RSS
  over a 40-step toy run (benchmarks/head_memory.py: the head's own handlers with toy executions,
  each variant in a fresh process; the other ``head_rss_*`` keys hold the details and the records-kept baseline).
- ``sim_gap``: the simulator, given the rates measured in the E run (execution trace from its
  shards with calls, output tokens, context and tool time; a serving replica fitted to the
  per-token decode time against the calls in flight per rollout cell; training tokens/s, switch
  costs, evaluation delay, optimizer step, weight push), drives the same E policy (same config)
  and predicts each cell's time fractions (rollout / train / switch / idle); sim_gap = mean
  absolute difference to the live fractions. The same measured rates are also given to the
  simulator for A and C (sim_gap_A, sim_gap_C). The engine here is NOT paced (the demo's
  embedded engine as it is; benchmarks/bench_live_sched.py is the paced check).

    python benchmarks/bench_online.py                 # writes benchmarks/results/online.json
    python benchmarks/bench_online.py --keep          # keep the run directories (printed)
    python benchmarks/bench_online.py --reuse DIR     # analyse DIR/{E,A,C} of an earlier --keep run
    python benchmarks/bench_online.py --rss-only      # refresh only the head_rss_* keys of online.json
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
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_live_sched import kv_tokens, trace_rows, write_trace  # noqa: E402  (one trace builder for both)

import head_memory  # noqa: E402  (the head's RSS over a 40-step toy run: head_rss_mb_step5 / _step40)

from gyre.config import load_config  # noqa: E402
from gyre.engine.pace import PACED_REPLICA  # noqa: E402
from gyre.events import BUCKETS, bucket_seconds  # noqa: E402
from gyre.sched import RunSpec  # noqa: E402
from gyre.sim.cost_model import ClusterModel  # noqa: E402
from gyre.sim.roofline import ReplicaSpec  # noqa: E402
from gyre.sim.simulator import SimSpec, simulate  # noqa: E402
from gyre.sim.workload import Workload  # noqa: E402
from gyre.traj.store import iter_executions  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "online.json"
CONFIG = REPO / "launchers" / "demo.toml"
STEPS, GROUP_SIZE, SEED = 3, 8, 0
COMMON = [f"run.steps={STEPS}", f"harness.group_size={GROUP_SIZE}", f"run.seed={SEED}",
          "proxy.port=0"]  # port 0: no clash with other runs on this machine
SCHEMES = {"E": ["sched.scheme=E"], "A": ["sched.scheme=A", "sched.rollout_cells_async=1"],
           "C": ["sched.scheme=C"]}
GOAL_MS = 100.0
R2T_PHASES, T2R_PHASES = ("drain", "release", "restore"), ("stash", "offload", "resume")


def _med(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _r(x, nd=4):
    return None if x is None else round(float(x), nd)


# ---- live runs ---------------------------------------------------------------------------------
def run_scheme(scheme: str, run_dir: Path) -> float:
    gyre = Path(sys.executable).parent / "gyre"
    cmd = [str(gyre), "run", "--config", str(CONFIG), "--no-plots", f"run.dir={run_dir}", *COMMON, *SCHEMES[scheme]]
    log = run_dir.parent / f"{scheme}.log"
    t = time.perf_counter()
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, timeout=900).returncode
    took = time.perf_counter() - t
    if rc != 0 or not (run_dir / "report.json").exists():
        raise SystemExit(f"bench_online: gyre run {scheme} failed (exit {rc}); see {log}")
    print(f"  {scheme}: {took:.1f} s (gyre run, start-up included)", flush=True)
    return took


def scheme_figures(report: dict) -> dict:
    cells = report["cells"]
    wall = sum(c["wall_s"] for c in cells)
    busy = sum(c["busy_rollout_s"] + c["busy_train_s"] for c in cells)
    return {
        "label": report["label"], "wall_s": _r(report["wall_s"], 2),
        "idle_fraction": _r(sum(c["idle_s"] for c in cells) / wall),
        "switching_fraction": _r(sum(c["switching_s"] for c in cells) / wall),
        "utilisation": _r(busy / wall),
        "switches": sum(c["switches"] for c in cells),
        "steps": len(report["steps"]), "executions": report["executions"], "errors": len(report["errors"]),
        "step_end_s": [_r(s["t_end"], 2) for s in report["steps"]],
        "reward_mean_per_step": [_r(s["reward_mean"], 3) for s in report["steps"]],
    }


# ---- switch control path -----------------------------------------------------------------------
def switch_path(report: dict) -> dict:
    sw = [p for c in report["cells"] for p in c["switch_phases"] if p.get("ok")]
    out = {}
    for name, to, phases in (("r2t", "train", R2T_PHASES), ("t2r", "rollout", T2R_PHASES)):
        ps = [p for p in sw if p["to"] == to]
        rt = [(p["wall_s"] - p.get("load", 0.0)) * 1e3 for p in ps]
        med = _med(rt)
        out[f"switch_{name}_ms"] = _r(med, 2)
        out[f"switch_{name}_n"] = len(ps)
        out[f"switch_{name}_max_ms"] = _r(max(rt), 2) if rt else None
        out[f"switch_{name}_phases_ms"] = {ph: _r(_med([p.get(ph) for p in ps]) * 1e3, 2) if ps else None
                                           for ph in phases}
        out[f"switch_{name}_agent_ms"] = _r(_med([(p["total"] - p.get("load", 0.0)) * 1e3 for p in ps]), 2)
        out[f"switch_{name}_load_ms"] = _r(_med([p.get("load", 0.0) * 1e3 for p in ps]), 2)
        out[f"switch_{name}_with_load_ms"] = _r(_med([p["wall_s"] * 1e3 for p in ps]), 2)
        out[f"switch_{name}_meets_goal"] = med is not None and med < GOAL_MS
    return out


# ---- what the live E run measured, as simulator inputs -----------------------------------------
def _t0(report: dict) -> float:
    return min(iv[1] for ivs in report["intervals"].values() for iv in ivs)


def _sweep_load(report: dict, recs) -> tuple[list[tuple[float, float]], float]:
    """Per call: (mean calls in flight per settled rollout cell over its lifetime, duration);
    and the time-weighted mean of that load over the time any call was in flight."""
    calls = [(c.t_start, c.t_end) for r in recs for c in r.tree.calls if c.t_end > c.t_start]
    rollout = [(s, e) for ivs in report["intervals"].values() for role, s, e in ivs if role == "rollout"]
    pts = sorted({t for c in calls for t in c} | {t for iv in rollout for t in iv})
    segs = []  # (a, b, load)
    for a, b in zip(pts, pts[1:]):
        if b <= a:
            continue
        m = (a + b) / 2
        inflight = sum(1 for s, e in calls if s <= m < e)
        if inflight:
            cells = sum(1 for s, e in rollout if s <= m < e)
            segs.append((a, b, inflight / max(1, cells)))
    tot = sum(b - a for a, b, _ in segs)
    mean = sum((b - a) * l for a, b, l in segs) / tot if tot else 1.0
    per_call = []
    for s, e in calls:
        w = sum((min(b, e) - max(a, s)) * l for a, b, l in segs if b > s and a < e)
        per_call.append((w / (e - s), e - s))
    return per_call, mean


def fit_replica(recs, per_call_load: list[tuple[float, float]]) -> tuple[dict, str]:
    """A serving replica (gyre.sim.roofline.ReplicaSpec) from the measured decode: least squares
    of per-token time on the calls in flight per rollout cell, t = a + b x max(L, 1), read as the
    roofline's step time: overhead a, and b = (mean context x KV bytes per token) / bandwidth
    (no weight term: on the CPU the fixed cost of a step is all overhead). One engine per cell:
    one replica of one 'GPU' per cell. Prefill is the paced spec's (the tiny model's measured CPU
    prefill rate, gyre/engine/pace.py)."""
    calls = [c for r in recs for c in r.tree.calls if c.t_end > c.t_start]
    xs = [max(load, 1.0) for load, _ in per_call_load]
    ys = [(c.t_end - c.t_start) / max(1, c.n_output) for c in calls]
    ctx = statistics.fmean(c.n_input + c.n_output / 2 for c in calls) if calls else 1.0
    bw = 1.0e12  # 1 TB/s: a unit, only b x bw / ctx matters
    a, b, why = statistics.fmean(ys), 0.0, ""
    if len(xs) >= 3 and max(xs) - min(xs) >= 0.5:
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        if slope > 0 and my - slope * mx > 0:
            a, b = my - slope * mx, slope
            why = (f"fitted on {len(xs)} calls: per-token time = {a * 1e3:.2f} ms + {b * 1e3:.3f} ms x calls per cell "
                   f"({min(xs):.1f}-{max(xs):.1f})")
        else:
            why = (f"per-token time did not grow with the calls per cell ({min(xs):.1f}-{max(xs):.1f}, slope "
                   f"{slope * 1e3:+.3f} ms): decode taken as load-flat at {a * 1e3:.2f} ms per token")
    else:
        why = f"per-cell load did not vary enough to fit: decode taken as load-flat at {a * 1e3:.2f} ms per token"
    spec = {"gpus": 1, "hbm_gb": 80.0, "hbm_tb_s": bw / 1e12, "peak_tflops": PACED_REPLICA.peak_tflops,
            "dense_gb": 0.0, "expert_gb": 0.0, "kv_bytes_per_token": b * bw / ctx, "overhead_ms": a * 1e3,
            "active_params": PACED_REPLICA.active_params, "prefill_mfu": PACED_REPLICA.prefill_mfu}
    return {**spec, "mean_context_tokens": ctx}, why


def measured_rates(report: dict, run_dir: Path, trace_csv: Path) -> tuple[dict, list[str]]:
    notes = []
    recs = list(iter_executions(run_dir / "shards"))
    rows = trace_rows(run_dir)  # groups in id order, with output tokens, context and tool time
    write_trace(rows, trace_csv)
    t0 = _t0(report)
    dur = [r.t_end - r.t_start for r in recs]
    calls = [len(r.tree.calls) for r in recs]
    segments = max(1, round(statistics.median(calls)))
    if len(set(calls)) > 1:
        notes.append(f"executions made {min(calls)}-{max(calls)} calls; the simulator splits each into "
                     f"{segments} call/environment segment(s) (SimSpec.segments is one number)")
    per_call, mean_load = _sweep_load(report, recs)
    replica, why = fit_replica(recs, per_call)
    notes.append(f"decode: {why}")
    # training: tokens of trained executions (the trace's tokens = what the sim trains) / busy train s
    ledger = [json.loads(l) for l in (run_dir / "ledger.jsonl").read_text().splitlines() if l.strip()]
    trained = {d["execution"] for d in ledger if d.get("admitted")}
    toks = {r["execution_id"]: float(r["tokens"]) for r in rows}
    busy_train = sum(c["busy_train_s"] for c in report["cells"])
    train_tps = sum(toks[e] for e in trained if e in toks) / busy_train
    # evaluation: from the last execution end of a step's groups to the last group's admission
    # (the evaluator is a 2-worker queue; the sim has one fixed delay per execution). Group ready
    # times are not in the report: the last group is taken as ready one mean micro-batch before
    # the step's reduce (t_end - push_s - reduce_s - mean micro-batch train time); the first
    # admission (the step's t_start) is kept as a lower bound.
    step_of = {d["group"]: d["step"] for d in ledger if d.get("admitted")}
    ends: dict[int, float] = {}
    for r in recs:
        if r.group in step_of:
            s = step_of[r.group]
            ends[s] = max(ends.get(s, 0.0), r.t_end)
    mbs = sum(st["micro_batches"] for st in report["steps"])
    mb_s = busy_train / mbs if mbs else 0.0
    first_lags = [st["t_start"] + t0 - ends[st["step"]] for st in report["steps"] if st["step"] in ends]
    last_lags = [st["t_end"] - st["reduce_s"] - st["push_s"] - mb_s + t0 - ends[st["step"]]
                 for st in report["steps"] if st["step"] in ends]
    eval_s = max(0.0, _med(last_lags) or 0.0)
    sw = [p for c in report["cells"] for p in c["switch_phases"] if p.get("ok")]
    to_train = _med([p["wall_s"] for p in sw if p["to"] == "train"]) or 0.0
    to_rollout = _med([p["wall_s"] for p in sw if p["to"] == "rollout"]) or 0.0
    opt = _med([st["reduce_s"] for st in report["steps"]]) or 0.0
    push = _med([st["push_s"] for st in report["steps"]]) or 0.0
    rates = {
        "executions": len(recs), "mean_duration_s": _r(statistics.fmean(dur), 3),
        "mean_calls": _r(statistics.fmean(calls), 2), "segments": segments,
        "model_share_measured": _r(min(1.0, sum(r["model_s"] for r in rows) / sum(dur))),
        "load_measured": _r(mean_load, 3), "replica": {k: (_r(v, 6) if isinstance(v, float) else v) for k, v in replica.items()},
        "train_tokens_per_s": _r(train_tps, 1), "trained_executions": len(trained),
        "busy_train_s": _r(busy_train, 3), "mean_micro_batch_train_s": _r(mb_s, 3),
        "eval_s": _r(eval_s, 3), "eval_last_group_lags_s": [_r(x, 3) for x in last_lags],
        "eval_first_admission_lags_s": [_r(x, 3) for x in first_lags],
        "to_train_s": _r(to_train, 4), "to_rollout_s": _r(to_rollout, 4), "push_s": _r(push, 5), "opt_s": _r(opt, 4),
        "reduce_s_median": _r(_med([st["reduce_s"] for st in report["steps"]]), 4),
        "weight_push_s_median": _r(_med([st["push_s"] for st in report["steps"]]), 5),
    }
    return rates, notes


# ---- simulator vs live -------------------------------------------------------------------------
def fractions(cells: list[dict]) -> list[dict]:
    """Each cell's time in the BUCKETS over its wall time: one mapping for live and simulated rows
    (both are gyre.events.RunStats.cell_time rows)."""
    return [{b: v / c["wall_s"] for b, v in bucket_seconds(c).items()} for c in cells]


def sim_compare(scheme: str, report: dict, rates: dict, trace_csv: Path) -> dict:
    cfg = load_config(str(CONFIG), [*COMMON, *SCHEMES[scheme]])
    n = cfg.sched.cells
    rep = {k: v for k, v in rates["replica"].items() if k != "mean_context_tokens"}
    cluster = ClusterModel(nodes=n, cell_nodes=1, gpus_per_node=1, replica=ReplicaSpec(**rep),
                           train_tokens_per_s=rates["train_tokens_per_s"], to_train_s=rates["to_train_s"],
                           to_rollout_s=rates["to_rollout_s"], push_s=rates["push_s"], eval_s=rates["eval_s"],
                           opt_s=rates["opt_s"], kv_tokens_per_replica=kv_tokens())
    workload = Workload.from_trace(trace_csv)
    sim_spec = SimSpec(segments=rates["segments"], tick_s=0.1)  # the head decides every 0.1 s
    res = simulate(RunSpec.from_config(cfg), workload, cluster, sim_spec)  # the live run's spec and hints
    sim = fractions(res.cell_stats)
    live = fractions(report["cells"])
    diffs = [abs(s[b] - l[b]) for s, l in zip(sim, live) for b in BUCKETS]
    pooled_sim = {b: statistics.fmean(s[b] for s in sim) for b in BUCKETS}
    pooled_live = {b: statistics.fmean(l[b] for l in live) for b in BUCKETS}
    return {
        "sim_gap": _r(statistics.fmean(diffs)),
        "sim_gap_pooled": _r(statistics.fmean(abs(pooled_sim[b] - pooled_live[b]) for b in BUCKETS)),
        "sim_makespan_s": _r(res.makespan_s, 2), "live_makespan_s": _r(report["wall_s"], 2),
        "makespan_ratio_sim_over_live": _r(res.makespan_s / report["wall_s"]),
        "sim_switches": sum(c["switches"] for c in res.cell_stats),
        "live_switches": sum(c["switches"] for c in report["cells"]),
        "sim_step_end_s": [_r(s["t_end"], 2) for s in res.step_stats],
        "live_step_end_s": [_r(s["t_end"], 2) for s in report["steps"]],
        "per_cell": [{"cell": i, "sim": {b: _r(s[b]) for b in BUCKETS}, "live": {b: _r(l[b]) for b in BUCKETS}}
                     for i, (s, l) in enumerate(zip(sim, live))],
        "pooled": {"sim": {b: _r(v) for b, v in pooled_sim.items()}, "live": {b: _r(v) for b, v in pooled_live.items()}},
    }


SIM_NOTES = [
    "fractions: live rollout = busy_rollout_s (union of the cell's calls), train = busy_train_s (micro-batch "
    "round trips), switch = switching_s, idle = idle_s, each over wall_s (they sum to 1); sim = the "
    "simulator's rollout/train/switch/idle buckets over its makespan. sim_gap = mean |sim - live| over "
    "3 cells x 4 buckets (cell i = cell i: both drivers pick cells by the same policy code); "
    "sim_gap_pooled = the same on the cell-mean fractions",
    "policy: RunSpec.from_config of the live run's config (its [sched] hints: to_train_s, push_s, "
    "execs_per_cell, min_dwell_s, ...), not hints built from the measured rates, so both drivers run the "
    "same policy object; the sim re-decides every 0.1 s like the head",
    "cluster: 3 cells of one 'node', cell scale 1; switch costs = median head round trip per direction "
    "of the E run (load phase included here: it is part of a switch's cost)",
    "opt_s = median reduce_s per step (all-reduce + optimizer step: trainers busy), push_s = median weight "
    "push per step (rollout cells pause); live push_s is ~0 in E (no cell is in rollout at a step end)",
    "training: the sim drains a step's tokens fluidly over all train cells at n x train_tokens_per_s "
    "(train_tokens_per_s = trained tokens / busy train seconds, per cell); live, work goes by whole "
    "micro-batches (2 per step here, one per group, as groups become ready), so the live train time "
    "lands on fewer cells: per-cell train fractions differ while the pooled one is close",
    "decode: a ReplicaSpec fitted to the measured per-token time of the E run's calls against the calls in "
    "flight per settled rollout cell (measured_rates.replica: overhead_ms = intercept, kv_bytes_per_token x "
    "mean context / bandwidth = slope); the simulator's decode is its roofline step time. Prefix-cache "
    "capacity = the embedded engine's (256 MB of float32 KV). execution calls, output tokens, unique tokens, "
    "context (2 x the mean while decoding) and tool time (wall minus model-call time) = the E run's own "
    "trace from its shards (benchmarks/bench_live_sched.trace_rows), groups in id order",
    "keys dropped with the old decode model (issue 19): measured_rates.ref_load, ref_load_measured, "
    "half_load (ClusterModel.speed, half_load, ref_load are gone), model_share (now an output of the "
    "simulator; the measured share is model_share_measured); added: measured_rates.replica, load_measured, opt_s",
    "the sim books a rollout cell's pause during the optimizer step + weight push as 'switch' (live: rollout, "
    "idle unless serving); the policy's initial roles cost nothing in the sim, while live the initial train "
    "cells of A switch once at start-up (A's 2 live switches)",
    "on this machine a step is ~2 s of rollout, ~10-25 s of evaluation (2 workers, 16 workspaces; it varies with the load other users put on the 2 cores) and ~2 s of "
    "training, so every scheme is ~95% idle and the absolute fraction gaps are small partly for that reason; "
    "the step-end times (sim_step_end_s vs live_step_end_s) and the makespan ratio are the sharper check",
    "A and C (sim_gap_A, sim_gap_C) reuse the rates measured in the E run (same workload and machine); "
    "their live runs recorded their own executions, which the sim does not replay",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    ap.add_argument("--reuse", help="analyse DIR/{E,A,C} of an earlier --keep run instead of running")
    ap.add_argument("--rss-only", action="store_true", help="measure only the head's RSS and update those keys")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    if args.rss_only:
        out = Path(args.out)
        result = json.loads(out.read_text()) if out.exists() else {}
        result.update(head_memory.measure())
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps({k: v for k, v in result.items() if k.startswith("head_rss_")}, indent=1))
        return 0
    t_all = time.perf_counter()
    base = Path(args.reuse) if args.reuse else Path(tempfile.mkdtemp(prefix="gyre-bench-online-"))
    run_s = {}
    try:
        if not args.reuse:
            print(f"bench_online: runs under {base}", flush=True)
            for s in SCHEMES:
                run_s[s] = round(run_scheme(s, base / s), 1)
        reports = {s: json.loads((base / s / "report.json").read_text()) for s in SCHEMES}
        schemes = {s: scheme_figures(r) for s, r in reports.items()}
        for s in schemes:
            schemes[s]["switch"] = {k: v for k, v in switch_path(reports[s]).items()
                                    if k.endswith(("_ms", "_n")) and not k.endswith("phases_ms")}
        sw = switch_path(reports["E"])
        trace = base / "E_trace.json"
        rates, notes = measured_rates(reports["E"], base / "E", trace)
        t_sim = time.perf_counter()
        sims = {s: sim_compare(s, reports[s], rates, trace) for s in SCHEMES}
        sim_wall = time.perf_counter() - t_sim
        rss = head_memory.measure()
    finally:
        if not args.keep and not args.reuse:
            shutil.rmtree(base, ignore_errors=True)
    total = time.perf_counter() - t_all
    result = {
        "config": {"file": "launchers/demo.toml", "overrides": COMMON, "schemes": SCHEMES,
                   "staleness": 0, "cells": 3, "groups_per_step": 2, "group_size": GROUP_SIZE, "steps": STEPS,
                   "model": "embedded tiny model, CPU (no GPU on this machine)"},
        **sw,
        "switch_goal_ms": GOAL_MS,
        "switch_source": "scheme E run, successful switches only; medians",
        "switch_excludes": "the agent's 'load' phase (weight bytes) is subtracted from the head round trip: "
                           "switch_*_ms = median(wall_s - load); *_with_load_ms keeps it; *_agent_ms = median "
                           "agent-side total - load; *_phases_ms = agent-side phase medians",
        **{f"{s}_{k}": v for s, f in schemes.items() for k, v in f.items()
           if k in ("wall_s", "idle_fraction", "switching_fraction", "utilisation", "switches")},
        "sim_gap": sims["E"]["sim_gap"],
        "sim_gap_pooled": sims["E"]["sim_gap_pooled"],
        "sim_makespan_ratio": sims["E"]["makespan_ratio_sim_over_live"],
        "sim_gap_A": sims["A"]["sim_gap"],
        "sim_gap_C": sims["C"]["sim_gap"],
        "sim_makespan_ratio_A": sims["A"]["makespan_ratio_sim_over_live"],
        "sim_makespan_ratio_C": sims["C"]["makespan_ratio_sim_over_live"],
        **rss,
        "schemes": schemes,
        "sim": sims["E"],
        "sim_other_schemes": {s: sims[s] for s in ("A", "C")},
        "measured_rates": rates,
        "notes": notes + SIM_NOTES,
        "bench_wall_s": round(total, 1),
        "gyre_run_s": run_s,
        "sim_wall_s": round(sim_wall, 3),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, (dict, list))}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
