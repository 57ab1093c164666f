"""`gyre plan`: sweep cell layouts, budgets, staleness and schemes for a workload (for HPC admins).

Prints a header naming the preset, model, GPU and the assumed unknowns (groups per step, training
cost per execution, tool time), then one table row per (nodes, cell size, scheme, staleness) with
the simulated end-to-end time, GPU-hours, its ratio to the lower bound and utilisation; Async's
split of rollout/training cells is searched and its best is reported (with the split). The
recommendation is made per node budget *and per staleness*: a staleness-2 run trains on older
samples (another algorithm), so it is never ranked against a staleness-0 run. A point it cannot
evaluate (Async on one cell) is listed with the reason. Runs on this machine by default, its points
in a pool of `--jobs` processes (rows in the sweep's order); `--executor local` fans the runs out as
submitit jobs on this machine, `--executor slurm` as Slurm jobs.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from gyre.config import ConfigError, Scheme, StalenessRule, load_config
from gyre.sched import SCHEMES, RunSpec
from gyre.sim.calibration import HARDWARE, MEM_FRACTION, PRESETS, check_layout, preset
from gyre.sim.cost_model import divisors
from gyre.sim.scenario import SCREEN_STEPS, Scenario, best_async
from gyre.sim.workload import Workload

_DEFAULT = preset("nl2repo-122b-32n")


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _words(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def plan_table(rows: list[dict]) -> str:
    lines = ["| nodes | cells × nodes | run | hours | GPU-h | × bound | utilisation | GPU-h wasted | |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['nodes']} | {r['cells']} × {r['cell_size']} | {r['label']} | – | – | – | – | – "
                         f"| not evaluated: {r['skipped']} |")
            continue
        mark = f"**recommended at staleness {r['staleness']}**" if r.get("recommended") else ""
        label = r["label"] + (f" ({r['async_split']} rollout cells)" if r.get("async_split") else "")
        lines.append(f"| {r['nodes']} | {r['cells']} × {r['cell_size']} | {label} | {r['hours']:.2f} "
                     f"| {r['gpu_hours']:.0f} | {r['ratio_to_lower_bound']:.3f} | {r['utilisation']:.1%} "
                     f"| {r['gpu_hours_wasted']:.0f} | {mark} |")
    return "\n".join(lines)


def header(args: argparse.Namespace) -> str:
    """What the plan assumes: the preset, model (the --model-config one where given), hardware and
    the unknowns no source states."""
    p = _preset(args)
    if getattr(args, "model_config", None):
        p = with_model_config(p, args.model_config)
    m, w = p.model, p.workload
    return "\n".join([
        f"gyre plan: preset {p.name}; model {m.name} ({m.params / 1e9:g}B total, {m.active / 1e9:g}B active"
        + (f", {m.experts} experts top-{m.topk}" if m.experts else "") + f"); {p.hw.name} x "
        f"{p.hw.gpus_per_node} GPUs per node; serving replica {m.replica_gpus} GPUs (FP8)",
        f"workload: {args.workload or w.name}; {w.mean_calls:g} calls, {w.mean_tokens:.3g} tokens "
        f"({w.output_share:.0%} decoded) per execution, G = {w.group_size}",
        f"assumed unknowns (the paper does not state them; change with the flags): groups per step "
        f"{args.groups_per_step} (--groups-per-step), training cost x{w.train_cost:g} of {w.mean_train_tokens:.3g} "
        f"tokens per execution (--train-cost), tool time {w.mean_tool_s:.0f} s per execution (--tool-s)",
        "staleness k > 0 trains on samples up to k syncs old (another algorithm): recommendations are "
        "made per staleness, never across"])


def _preset(args: argparse.Namespace):
    p = preset(args.preset)
    wl = p.workload
    if getattr(args, "train_cost", None) is not None:
        wl = replace(wl, train_cost=args.train_cost)
    if getattr(args, "tool_s", None) is not None:
        wl = replace(wl, mean_tool_s=args.tool_s)
    hw = HARDWARE[args.gpu] if getattr(args, "gpu", None) else p.hw
    if getattr(args, "gpus_per_node", None) is not None:
        hw = replace(hw, gpus_per_node=args.gpus_per_node)
    return p.with_(workload=wl, hw=hw)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default=_DEFAULT.name, choices=sorted(PRESETS),
                   help="model, hardware and rates (gyre/sim/calibration.py); its workload is the default")
    p.add_argument("--workload", default="", help="workload preset or trace file (CSV/JSON); default: the preset's")
    p.add_argument("--config", type=Path, default=None,
                   help="a run's TOML: sweep around that run (its scheme, staleness, steps, groups, cells, burst "
                        "order and zero-variance rule are the defaults of the flags below)")
    p.add_argument("--nodes", type=_ints, default=None, help="node budgets, e.g. 8,16,32 (default: 8,16,32)")
    p.add_argument("--cell-nodes", type=_ints, default=None, help="cell sizes in nodes, e.g. 4,8 "
                   "(default: 4,8; a cell too small for the model's training state is refused)")
    p.add_argument("--cells", type=_ints, default=None, help="only these cell counts (default: all that fit)")
    p.add_argument("--staleness", type=_ints, default=None, help="staleness bounds, e.g. 0,1,2 (default: 0,2)")
    p.add_argument("--schemes", type=_words, default=None, help=f"any of {','.join(SCHEMES)} (default: E,A,C)")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps per simulated run (default: the preset's; fewer steps plan faster, "
                        "but under 12 the last step's drain decides close comparisons)")
    p.add_argument("--groups-per-step", type=int, default=None, help=f"default: {_DEFAULT.groups_per_step}")
    p.add_argument("--seed", type=int, default=None, help="workload seed (default: 0)")
    for name, what in (("to-train-s", "rollout->train switch"), ("to-rollout-s", "train->rollout switch"),
                       ("push-s", "weight push per rollout round"), ("eval-s", "evaluation of a workspace")):
        p.add_argument(f"--{name}", type=float, default=None, help=f"seconds per {what} (default: the preset's)")
    p.add_argument("--train-tokens-per-s", type=float, default=None,
                   help="training tokens/s of one cell (default: FLOP arithmetic for the cell size)")
    p.add_argument("--gpu", choices=sorted(HARDWARE), default=None,
                   help="GPU kind (default: the preset's); figures and sources in gyre/sim/calibration.py")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default: the preset's, 8)")
    p.add_argument("--train-cost", type=float, default=None,
                   help="training tokens one execution costs, as a multiple of the workload's (default: the preset's)")
    p.add_argument("--tool-s", type=float, default=None,
                   help="tool/environment seconds per execution (default: the preset's, pinned to the 1.93 h profile)")
    p.add_argument("--staleness-rule", choices=tuple(StalenessRule), default=None, help="default: window")
    p.add_argument("--steps-per-sync", type=int, default=None, help="optimizer steps per rollout round (default: 1)")
    p.add_argument("--executor", choices=("inline", "local", "slurm"), default="inline",
                   help="inline (default: this machine, --jobs processes), or submitit jobs: local processes or Slurm")
    p.add_argument("--jobs", type=int, default=None,
                   help=f"inline: points simulated at once, one process each (default: the CPUs this process "
                        f"may use, {usable_cpus()} here; 1 = in this process)")
    p.add_argument("--jobs-dir", default="gyre-plan-jobs", help="submitit log folder")
    p.add_argument("--partition", default="", help="Slurm partition for --executor slurm")
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    p.add_argument("--model-config", type=Path, default=None,
                   help="a model's config.json (or its directory), any family gyre.model supports: its total/active "
                        "parameters and attention shape replace the preset's model; rates stay the preset's")


def with_model_config(p, path):
    """The preset with its model replaced by the one `path` describes (gyre.model.params counts;
    a serving replica: the fewest GPUs, a power of two, whose HBM share holds the weights)."""
    # gyre.model imports torch: only `--model-config` pays for it (`gyre plan --help` stays fast)
    from gyre.model import ModelFormatError
    from gyre.model.params import param_counts

    try:
        c = param_counts(path)
    except ModelFormatError as e:
        raise ConfigError(f"--model-config: {e}") from None
    # the weights take at most 70% of what SGLang may use of the replica's HBM; the rest is KV
    need = c["total"] * p.model.serve_bytes_per_param / (p.hw.hbm_gb * 1e9 * MEM_FRACTION * 0.7)
    replica = 1 << max(0, math.ceil(math.log2(max(need, 1.0))))
    model = dataclasses.replace(
        p.model, name=f"{c['model_type']}:{Path(path).name}", params=float(c["total"]), active=float(c["active"]),
        attn_layers=c["attn_layers"], attn_dim=c["attn_dim"], replica_gpus=replica, experts=c["experts"],
        topk=c["top_k"], kv_bytes_per_token=float(c["kv_bytes_per_token"]),
        state_bytes_per_request=float(c["state_bytes_per_request"]),
        sources={"params": f"{path}: gyre.model.params (total {c['total']:,}, active {c['active']:,})",
                 "replica_gpus": "computed: FP8 weights within 70% of the replica's usable HBM, a power of two",
                 "kv_bytes_per_token": "computed: full-attention layers x K,V x KV heads x head dim x bf16",
                 "state_bytes_per_request": "computed: Gated DeltaNet layers x (fp32 state + bf16 conv window)"})
    return dataclasses.replace(p, model=model)


_DEFAULTS = {"nodes": [8, 16, 32], "cell_nodes": [4, 8], "staleness": [0, 2], "schemes": ["E", "A", "C"],
             "steps": None, "groups_per_step": _DEFAULT.groups_per_step, "seed": 0, "staleness_rule": "window",
             "steps_per_sync": 1}


def with_defaults(args: argparse.Namespace) -> RunSpec | None:
    """Fill the flags not given: from the run of `--config` (returned as the spec the sweep varies)
    or the built-in defaults."""
    base, given = None, {}
    if getattr(args, "config", None) is not None:
        cfg = load_config(args.config)
        base, s = RunSpec.from_config(cfg), cfg.sched
        given = {"nodes": [s.cells * s.cell_nodes], "cell_nodes": [s.cell_nodes], "staleness": [s.staleness],
                 "schemes": [str(s.scheme)], "steps": cfg.run.steps, "groups_per_step": cfg.run.groups_per_step,
                 "seed": cfg.run.seed, "staleness_rule": str(s.staleness_rule), "steps_per_sync": s.steps_per_sync}
    for name, default in _DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, given.get(name, default))
    return base


def scenarios(args: argparse.Namespace) -> list[Scenario]:
    """Validate the sweep and list its runs; a bad parameter raises ConfigError naming it."""
    base = with_defaults(args)
    for name in ("nodes", "cell_nodes", "staleness"):
        if not getattr(args, name):
            raise ConfigError(f"--{name.replace('_', '-')}: give at least one value")
    if any(n <= 0 for n in args.nodes):
        raise ConfigError(f"--nodes: node budgets must be positive, got {args.nodes}")
    if any(c <= 0 for c in args.cell_nodes):
        raise ConfigError(f"--cell-nodes: cell sizes must be positive, got {args.cell_nodes}")
    if args.cells is not None and any(c <= 0 for c in args.cells):
        raise ConfigError(f"--cells: zero or negative cells make no cluster, got {args.cells}")
    if any(k < 0 for k in args.staleness):
        raise ConfigError(f"--staleness: must be >= 0, got {args.staleness}")
    if args.steps is None:
        args.steps = preset(args.preset).steps
    if args.steps < 1 or args.groups_per_step < 1 or args.steps_per_sync < 1:
        raise ConfigError("--steps, --groups-per-step and --steps-per-sync must be >= 1")
    if getattr(args, "jobs", None) is not None and args.jobs < 1:
        raise ConfigError(f"--jobs: at least 1 process, got {args.jobs}")
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node: must be >= 1, got {args.gpus_per_node}")
    if args.train_cost is not None and args.train_cost <= 0:
        raise ConfigError(f"--train-cost: must be positive, got {args.train_cost}")
    if args.tool_s is not None and args.tool_s < 0:
        raise ConfigError(f"--tool-s: must be >= 0 seconds, got {args.tool_s}")
    p = _preset(args)
    if getattr(args, "model_config", None):
        p = with_model_config(p, args.model_config)
    bad = [s for s in args.schemes if s not in SCHEMES]
    if bad or not args.schemes:
        raise ConfigError(f"--schemes: unknown {bad or 'none given'}; choose from {', '.join(SCHEMES)}")
    over = {}
    for name in ("to_train_s", "to_rollout_s", "push_s", "eval_s"):
        v = getattr(args, name)
        if v is not None and v < 0:
            raise ConfigError(f"--{name.replace('_', '-')}: times cannot be negative, got {v}")
        if v is not None:
            over[name] = v
    for name in ("train_tokens_per_s",):
        v = getattr(args, name)
        if v is not None and v <= 0:
            raise ConfigError(f"--{name.replace('_', '-')}: must be positive, got {v}")
        if v is not None:
            over[name] = v
    for n, c in itertools.product(args.nodes, args.cell_nodes):
        if c > n:
            raise ConfigError(f"cell size {c} is larger than {n} nodes: that layout has zero cells")
        if n % c:
            raise ConfigError(f"cell size {c} does not divide {n} nodes; divisors of {n}: "
                              f"{', '.join(map(str, divisors(n)))}")
    for c in sorted(set(args.cell_nodes)):
        check_layout(p.model, c, p.hw)  # memory: refused with the numbers
    workload = args.workload or p.workload
    Workload.named(workload, args.seed)  # fail early on a bad preset or trace
    out = []
    for n, c, scheme, k in itertools.product(args.nodes, args.cell_nodes, args.schemes, args.staleness):
        if args.cells is not None and n // c not in args.cells:
            continue
        try:
            cluster = p.cluster(nodes=n, cell_nodes=c, **over)
        except ConfigError as e:
            raise ConfigError(f"{n} nodes in cells of {c}: {e}") from None
        out.append(Scenario(scheme, k, cluster, workload=workload, steps=args.steps,
                            groups_per_step=args.groups_per_step, seed=args.seed, record=False,
                            staleness_rule=args.staleness_rule, steps_per_sync=args.steps_per_sync,
                            preset=p.name, base=base))
    if not out:
        raise ConfigError("the sweep is empty: no (nodes, cell size, cells) combination is left")
    return out


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def run_one(s: Scenario) -> dict:
    """One sweep point as a plain row (module level so submitit can pickle it). Async's split is
    searched (runs that cannot win are given up) and its best reported; a point that cannot run
    says why."""
    if s.scheme == Scheme.A and s.cluster.cells < 2:
        return _point(s) | {"skipped": f"async needs a rollout pool and a training pool; {s.cluster.cells} cell holds one"}
    if s.scheme == Scheme.A:
        r, by_split = best_async(s, search=True, prune=True, screen_steps=SCREEN_STEPS)
    else:
        r, by_split = s.run(), {}
    d = r.to_dict()
    return {k: d[k] for k in ("label", "scheme", "staleness", "nodes", "cells", "cell_size", "hours",
                              "lower_bound_hours", "ratio_to_lower_bound", "utilisation",
                              "gpu_hours_used", "gpu_hours_wasted", "switches", "evictions",
                              "model_wait_share")} | {
        "label": r.label, "not_admitted": sum(r.not_admitted.values()),
        "gpu_hours": round(r.gpu_hours("rollout", "train", "switch", "idle"), 1),
        "async_split": r.async_rollout_cells if s.scheme == Scheme.A else None,
        "async_hours_by_split": {str(k): round(v, 3) for k, v in by_split.items()} or None,
        # splits whose run was given up once it was slower than the best: hours simulated by then
        "async_given_up_hours": {str(k): round(v, 3) for k, v in r.async_given_up.items()} or None}


def execute(scs: list[Scenario], executor: str, jobs_dir: str = "gyre-plan-jobs",
            partition: str = "", jobs: int = 1) -> Iterator[dict]:
    """Rows as their points finish (inline: in the sweep's order; submitit: as jobs end). A point
    that fails becomes a row saying why; the sweep goes on."""
    if executor == "inline":
        if jobs > 1 and len(scs) > 1:
            yield from _pooled(scs, jobs)
            return
        for s in scs:
            yield _guarded(s)
        return
    import submitit  # only the fan-out needs it

    ex = submitit.LocalExecutor(folder=jobs_dir) if executor == "local" else submitit.AutoExecutor(folder=jobs_dir)
    params = {"timeout_min": 60}
    if executor == "slurm" and partition:
        params["slurm_partition"] = partition
    ex.update_parameters(**params)
    jobs = ex.map_array(_guarded, scs)
    pending = dict(zip(jobs, scs))
    while pending:
        for job in [j for j in pending if j.done()]:
            s = pending.pop(job)
            try:
                yield job.result()
            except Exception as e:  # the job itself died (killed, out of memory)
                yield _failed_row(s, f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}")
        if pending:
            time.sleep(0.5)  # polling submitit's job states; nothing is decided by this wait


def _pooled(scs: list[Scenario], jobs: int) -> Iterator[dict]:
    """The points in a pool of processes, heaviest first (so no long point starts last while the
    other processes sit idle), rows yielded in the sweep's order. Closing the iterator (Ctrl-C)
    stops the workers."""
    ex = ProcessPoolExecutor(min(jobs, len(scs)), mp_context=multiprocessing.get_context("spawn"))
    procs = []
    try:
        order = sorted(range(len(scs)), key=lambda i: (_weight(scs[i]), i))
        futures = {i: ex.submit(_guarded, scs[i]) for i in order}
        procs = list(ex._processes.values())  # started by submit; stopped below, not waited for
        for i in range(len(scs)):
            try:
                yield futures[i].result()
            except Exception as e:  # its worker died (killed, out of memory)
                yield _failed_row(scs[i], f"{type(e).__name__}: {e}")
    finally:
        for p in procs:
            p.terminate()  # a point in progress is not waited for
        ex.shutdown(wait=True, cancel_futures=True)  # (the pool sees its workers gone and ends)


def _weight(s: Scenario) -> tuple:
    """Sort key, heaviest point first: an Async point searches several splits (3-5 full runs at
    64 nodes); a higher staleness keeps more executions running (more events per step); more
    steps and more cells (smaller ones at the same nodes) mean more events."""
    return (s.scheme != Scheme.A, -s.staleness, -s.steps, -s.cluster.cells)


def _point(s: Scenario) -> dict:
    return {"label": f"{s.scheme}{s.staleness}", "scheme": s.scheme, "staleness": s.staleness,
            "nodes": s.cluster.nodes, "cells": s.cluster.cells, "cell_size": s.cluster.cell_nodes}


def _failed_row(s: Scenario, why: str) -> dict:
    return _point(s) | {"skipped": f"failed: {why}", "failed": True}


def _guarded(s: Scenario) -> dict:
    """run_one, with a failing point turned into a row (the sweep keeps what it has)."""
    try:
        return run_one(s)
    except Exception as e:
        return _failed_row(s, f"{type(e).__name__}: {e}")


TIE = 0.01  # runs within 1% of the recommended one are told as ties: below the model's accuracy
SHORT_HORIZON = 12  # fewer steps and the last step's drain decides a comparison (issue 33)


def recommend(rows: list[dict]) -> list[dict]:
    """Mark the fastest run per node budget and staleness (fewer switches breaks ties); sort for
    the table. Skipped points are listed last in their budget, never recommended. Runs within
    TIE of the recommended one are marked as ties."""
    rows = sorted(rows, key=lambda r: (r["nodes"], r["staleness"], bool(r.get("skipped")),
                                       r.get("hours", 0.0), r.get("switches", 0)))
    best: dict[tuple, float] = {}
    for r in rows:
        key = (r["nodes"], r["staleness"])
        r["recommended"] = not r.get("skipped") and key not in best
        if r["recommended"]:
            best[key] = r["hours"]
        r["tie"] = (not r.get("skipped") and not r["recommended"] and key in best
                    and r["hours"] <= best[key] * (1 + TIE))
    return rows


def config_line(r: dict) -> str:
    """The `gyre run`/`gyre submit` overrides that run a recommended point (the [sched] keys)."""
    keys = [f"sched.scheme={r['scheme']}", f"sched.staleness={r['staleness']}", f"sched.cells={r['cells']}",
            f"sched.cell_nodes={r['cell_size']}"]
    if r.get("async_split"):
        keys.append(f"sched.rollout_cells_async={r['async_split']}")
    return " ".join(keys)


def run(args: argparse.Namespace) -> int:
    scs = scenarios(args)  # fills the flags not given (header and the summary line read them)
    print(header(args))
    steps = scs[0].steps
    jobs = args.jobs or usable_cpus()
    how = f"inline, {min(jobs, len(scs))} processes" if args.executor == "inline" and jobs > 1 else args.executor
    print(f"{len(scs)} simulated points ({how}) of {steps} steps; Async at its best split (searched)",
          file=sys.stderr)
    if steps < SHORT_HORIZON:
        print(f"note: {steps} steps is a short horizon: the last step's drain weighs on every ranking; "
              f"use --steps {SHORT_HORIZON} or more before acting on a difference of a few percent", file=sys.stderr)
    rows: list[dict] = []
    interrupted = False
    bar = tqdm(total=len(scs), desc="gyre plan", unit="point", file=sys.stderr, disable=None)
    points = execute(scs, args.executor, args.jobs_dir, args.partition, jobs)
    try:
        for r in points:
            rows.append(r)
            bar.update(1)
            done = (f"{r['hours']:.2f} h" if not r.get("skipped") else r["skipped"])
            bar.write(f"  {r['nodes']} nodes, {r['cells']} x {r['cell_size']}: {r['label']} {done}", file=sys.stderr)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        points.close()  # a pool stops its workers
        bar.close()
    if interrupted:
        print(f"interrupted: {len(rows)} of {len(scs)} points finished; the table below holds those",
              file=sys.stderr)
    if not rows:
        return 130 if interrupted else 1
    rows = recommend(rows)
    print(plan_table(rows))
    for r in rows:
        if r["recommended"]:
            cells = f"{r['cells']} cell{'s' if r['cells'] != 1 else ''}"
            split = f" with {r['async_split']} rollout cells" if r.get("async_split") else ""
            ties = [t["label"] for t in rows if t.get("tie") and (t["nodes"], t["staleness"]) == (r["nodes"], r["staleness"])]
            tie = f" (a tie within {TIE:.0%} with {', '.join(ties)})" if ties else ""
            print(f"recommended for {r['nodes']} nodes at staleness {r['staleness']}: {cells} of "
                  f"{r['cell_size']} nodes, {r['label']}{split}: {r['hours']:.1f} h, {r['gpu_hours']:.0f} GPU-h, "
                  f"{r['utilisation']:.0%} busy, {r['ratio_to_lower_bound']:.2f}x the lower bound{tie}")
            print(f"  apply: {config_line(r)}")
    failed = [r for r in rows if r.get("failed")]
    if failed:
        print(f"{len(failed)} point(s) failed; their rows say why", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return 130 if interrupted else (1 if failed else 0)
