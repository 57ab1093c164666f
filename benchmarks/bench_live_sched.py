"""Live check of the schedulers where the number of rollout cells matters (issue 19 item 8, issue 33 item 6).

E, A (at its best split, searched in the simulator) and C run live with `gyre run` on 3 local
cells (processes under mpiexec) at staleness 0, with the **paced** embedded engine
(``engine.pace = true``: every decode step lasts the roofline step time of its batch under
gyre.engine.pace.PACED_REPLICA, so an engine behaves like a loaded GPU replica, throughput-bound
beyond ~4 calls), the **paced** trainer (``train.pace_tokens_per_s``: a training cell trains at a
stated rate, k cells k times it, so training is a real share of cell time and elasticity matters)
and the long-tailed harness (gyre.harness.long_tail_agent: 8 calls of 24 output tokens, seeded
two-level lognormal tool time). 32 executions run at once: ~10 per engine under C, far past the
knee, so decode is throughput-bound and a scheme with fewer rollout cells decodes slower.

Every scheme runs `--repeats` times (default 3). A gate reads each run's own call records: a run
whose worst engine decoded more than GATE_TOLERANCE slower than the paced spec at its own load
(a loaded machine) is rejected, recorded with why, not used, and run again (`--retries`).

Then the simulator runs each accepted run's parameters: the paced ReplicaSpec, the rates the run
measured (switch times, weight push and optimizer step, evaluation delay, training tokens per
cell-second), its executions as a trace (calls, output tokens, unique tokens, context, tool time =
wall time minus model-call time) and its router's calls per endpoint (SimSpec.router_spread),
with the live run's own policy object (RunSpec.from_config of the same config). Reported: per
scheme the median, min and max over repeats of live_s_*, sim_s_* (and sim_s_even_*: the even
pool), sim_over_live_*, train_share_*; the ranking of the medians and how many repeats agree;
how many runs the gate rejected. Nothing is fitted to a makespan. benchmarks/results/live_sched.json
is written only when every scheme has `--repeats` accepted runs.

    python benchmarks/bench_live_sched.py            # writes benchmarks/results/live_sched.json
    python benchmarks/bench_live_sched.py --repeats 5 --retries 2
    python benchmarks/bench_live_sched.py --half     # also runs A at the half split live (if it differs)
    python benchmarks/bench_live_sched.py --keep     # keep the run directories (printed)
    python benchmarks/bench_live_sched.py --reuse DIR  # analyse DIR/r<repeat>-<scheme>-<attempt> of a --keep run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gyre.engine.pace import PACED_REPLICA, prefix_cache_tokens  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "live_sched.json"
CONFIG = REPO / "launchers" / "demo.toml"
SUITE = REPO / "benchmarks" / "live_sched_suite"
CELLS, STEPS, GROUPS, GROUP_SIZE, STALENESS, SEED = 3, 3, 4, 8, 0, 0
CALLS, MAX_TOKENS, TOOL_MEAN_S, SIGMA_TASK, SIGMA_EXEC = 8, 24, 0.5, 0.3, 0.6
PREFIX_CACHE_MB = 256  # the embedded engine's default (gyre.engine.cli --prefix-cache-mb)
HARNESS = ["{python}", "-m", "gyre.harness.long_tail_agent", "--execution-id", "{execution_id}",
           "--calls", str(CALLS), "--max-tokens", str(MAX_TOKENS), "--tool-mean-s", str(TOOL_MEAN_S),
           "--sigma-task", str(SIGMA_TASK), "--sigma-exec", str(SIGMA_EXEC), "--seed", str(SEED)]
# Policy hints (the live head's and the simulated policy's: the same config): this machine's
# order of magnitude from earlier runs (benchmarks/results/online.json), not tuned to a result.
# The paced trainer (train.pace_tokens_per_s, gyre/train/pace.py): a training cell trains this many
# tokens per second, k cells k times it. Stated so that training is a real share of cell time here
# (simulated on the executions of the earlier one-repeat run: E ~42%, C ~36%, A ~25%, whose fixed
# pools idle the rest), and told to the policy as its training rate (the configured rate, not a fit).
TRAIN_PACE_TOKENS_PER_S = 500
HINTS = ["sched.to_train_s=0.1", "sched.to_rollout_s=0.1", "sched.push_s=0.3", "sched.min_dwell_s=0.5",
         f"sched.train_tokens_per_s={TRAIN_PACE_TOKENS_PER_S}", "sched.eval_s=0.5"]
# The gate: a run is rejected when an engine's calls decoded more than this share slower than the
# paced spec at that engine's own load (decode_spec_worst_engine): its CPU could not keep the pace
# (a loaded machine), so its makespan says more about the load than about the scheduler.
GATE_TOLERANCE = 0.10
REPEATS, RETRIES = 3, 1


def common() -> list[str]:
    """Overrides of launchers/demo.toml shared by every run (and by the simulated policies)."""
    return [f"run.steps={STEPS}", f"run.groups_per_step={GROUPS}", f"run.seed={SEED}", "proxy.port=0",
            f"harness.suite={SUITE}", f"harness.command={json.dumps(HARNESS)}", f"harness.group_size={GROUP_SIZE}",
            f"harness.concurrency={GROUPS * GROUP_SIZE}", "harness.timeout_s=300",
            # no sandbox: bubblewrap start-up per harness and evaluation costs CPU the 2 cores lack, and
            # isolation is not what is measured; PYTHONPATH passed so a worktree's gyre is the one run
            "harness.sandbox=none", 'harness.pass_env=["PATH", "HOME", "LANG", "TMPDIR", "PYTHONPATH"]',
            "eval.workers=4", "eval.timeout_s=60", "engine.pace=true",
            f"train.pace_tokens_per_s={TRAIN_PACE_TOKENS_PER_S}",
            f"sched.cells={CELLS}", f"sched.staleness={STALENESS}", *HINTS]


def scheme_overrides(scheme: str, split: int = 0) -> list[str]:
    out = [f"sched.scheme={scheme}"]
    if scheme == "A":
        out.append(f"sched.rollout_cells_async={split}")
    return out


def _med(xs) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else 0.0


def _r(x, nd=4):
    return None if x is None else round(float(x), nd)


# ---- live ----------------------------------------------------------------------------------------
def run_live(name: str, over: list[str], run_dir: Path) -> tuple[dict, float]:
    gyre = Path(sys.executable).parent / "gyre"
    cmd = [str(gyre), "run", "--config", str(CONFIG), "--no-plots", f"run.dir={run_dir}", *common(), *over]
    log = run_dir.parent / f"{name}.log"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t = time.perf_counter()
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, timeout=900, env=env).returncode
    took = time.perf_counter() - t
    if not (run_dir / "report.json").exists():
        raise SystemExit(f"bench_live_sched: gyre run {name} failed (exit {rc}); see {log}")
    report = json.loads((run_dir / "report.json").read_text())
    if rc != 0:  # e.g. MPI_Finalize failing after the run (a network device gone): the loop's record stands
        if len(report["steps"]) != STEPS or report.get("failed"):
            raise SystemExit(f"bench_live_sched: gyre run {name} failed (exit {rc}); see {log}")
        print(f"  {name}: gyre run exited {rc} after all {STEPS} steps were committed (see {log}); kept", flush=True)
    report["gyre_run_rc"] = rc
    print(f"  {name}: loop {report['wall_s']:.1f} s, gyre run {took:.1f} s, load {os.getloadavg()[0]:.1f}", flush=True)
    return report, took


# ---- the gate, repeats ---------------------------------------------------------------------------
def gate(rates: dict, tolerance: float = GATE_TOLERANCE) -> dict:
    """Accept a run only if every engine decoded within `tolerance` of the paced spec at its own
    load; a run without decode records cannot show it kept the pace and is rejected too."""
    worst = rates.get("decode_spec_worst_engine")
    limit = 1.0 + tolerance
    if worst is None:
        return {"passed": False, "why": "no decode records: cannot tell whether the engines kept the pace",
                "worst_engine": None, "limit": limit}
    if worst > limit:
        return {"passed": False, "worst_engine": round(worst, 4), "limit": limit,
                "why": f"an engine decoded {worst:.3f} spec tokens per token (> {limit:.2f}): it overran the "
                       f"paced spec, the machine was loaded"}
    return {"passed": True, "why": None, "worst_engine": round(worst, 4), "limit": limit}


def spread_of(values: list[float]) -> dict:
    """Median, min, max and the values of one figure over the accepted repeats."""
    xs = [float(x) for x in values if x is not None]
    if not xs:
        return {"median": None, "min": None, "max": None, "runs": []}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


# figures of each run aggregated over the accepted repeats (median, min, max, per run)
REPEATED = ("live_s", "sim_s", "sim_s_even", "sim_over_live", "sim_even_over_live", "train_share", "train_share_of_busy",
            "busiest_endpoint_over_mean", "busiest_inflight_over_mean", "busiest_serving_load_over_mean",
            "decode_spec_worst_engine",
            "train_tokens_per_s", "busy_train_s")


def aggregate(runs: list[dict], names: list[str], main3=("E", "A", "C")) -> dict:
    """Per scheme: each figure of REPEATED over its accepted runs; the rankings of the medians
    (live, simulated with the router's spread, simulated even); per repeat with all of `main3`
    accepted, whether its own live ranking is the medians' and whether its simulated ranking
    matches its live one; how many runs the gate rejected and why."""
    ok = [r for r in runs if r["gate"]["passed"]]
    out: dict = {}
    for n in names:
        mine = [r for r in ok if r["name"] == n]
        out[f"accepted_{n}"] = len(mine)
        for k in REPEATED:
            sp = spread_of([r.get(k) for r in mine])
            out[f"{k}_{n}"] = _r(sp["median"])
            out[f"{k}_{n}_min"], out[f"{k}_{n}_max"] = _r(sp["min"]), _r(sp["max"])
            out[f"{k}_{n}_runs"] = [_r(x) for x in sp["runs"]]
    have = [n for n in main3 if out[f"accepted_{n}"]]
    med = {k: {n: out[f"{k}_{n}"] for n in have} for k in ("live_s", "sim_s", "sim_s_even")}
    live_rank = ranking(med["live_s"])
    out.update({"ranking_live": "<".join(live_rank), "ranking_sim": "<".join(ranking(med["sim_s"])),
                "ranking_sim_even": "<".join(ranking(med["sim_s_even"])),
                "ranking_matches": len(have) == len(main3) and ranking(med["sim_s"]) == live_rank,
                "ranking_even_matches": len(have) == len(main3) and ranking(med["sim_s_even"]) == live_rank})
    by_repeat: dict[int, dict] = {}
    for r in ok:
        if r["name"] in main3:
            by_repeat.setdefault(r["repeat"], {})[r["name"]] = r
    complete = [rr for rr in by_repeat.values() if len(rr) == len(main3)]
    out["repeats_complete"] = len(complete)
    out["repeats_live_ranking_as_medians"] = sum(
        ranking({n: rr[n]["live_s"] for n in main3}) == live_rank for rr in complete)
    out["repeats_sim_ranking_matches_live"] = sum(
        ranking({n: rr[n]["sim_s"] for n in main3}) == ranking({n: rr[n]["live_s"] for n in main3}) for rr in complete)
    rejected = [r for r in runs if not r["gate"]["passed"]]
    out["runs_total"], out["runs_rejected"] = len(runs), len(rejected)
    out["rejections"] = [{"repeat": r["repeat"], "name": r["name"], "attempt": r["attempt"], "why": r["gate"]["why"],
                          "load_avg_1m": r.get("load_avg_1m")} for r in rejected]
    return out


# ---- what a live run measured, as simulator inputs ----------------------------------------------
def trace_rows(run_dir: Path) -> list[dict]:
    """The run's executions in the simulator's trace schema, groups in id order. context_tokens is
    twice the call-weighted mean context while decoding (the simulator's context grows linearly
    from 0, so its mean is context_tokens / 2); tool_s = wall time not spent in model calls."""
    from gyre.traj.store import iter_executions

    rows = []
    for r in iter_executions(run_dir / "shards"):
        calls = r.tree.calls
        call_s = sum(c.t_end - c.t_start for c in calls)
        out = sum(c.n_output for c in calls)
        ctx = statistics.fmean(c.n_input + c.n_output / 2 for c in calls) if calls else 0.0
        tokens = float(r.tree.stats().unique_tokens)
        dur = r.t_end - r.t_start
        rows.append({"execution_id": r.execution_id, "group": r.group, "duration_s": round(dur, 4),
                     "calls": len(calls), "tokens": tokens, "train_tokens": tokens,
                     "context_tokens": round(2 * ctx, 2), "output_tokens": float(out),
                     "tool_s": round(max(0.0, dur - call_s), 4), "model_s": round(call_s, 4), "t_end": r.t_end})
    rows.sort(key=lambda x: (int(x["group"]), x["execution_id"]))
    return rows


def decode_vs_spec(run_dir: Path, report: dict) -> dict:
    """decode_vs_spec_calls of the run's recorded calls, and each engine's load while its cell
    served (serving_loads: cells.json maps engine URLs to cells, report.json has their roles)."""
    from gyre.traj.store import iter_executions

    calls = [c for r in iter_executions(run_dir / "shards") for c in r.tree.calls]
    out = decode_vs_spec_calls(calls)
    cells = json.loads((run_dir / "cells.json").read_text())["cells"] if (run_dir / "cells.json").exists() else []
    url_cell = {c["engine_url"]: c["cell"] for c in cells if c.get("engine_url")}
    rollout_s = {int(cell): sum(b - a for role, a, b in ivs if role == "rollout")
                 for cell, ivs in report.get("intervals", {}).items()}
    loads = serving_loads(calls, url_cell, rollout_s)
    out["serving_load_per_endpoint"] = None if loads is None else [round(x, 4) for x in loads]
    out["busiest_serving_load_over_mean"] = max(loads) / statistics.fmean(loads) if loads else None
    return out


def serving_loads(calls, url_cell: dict, rollout_s: dict) -> list[float] | None:
    """Per engine, its mean calls in flight while its cell was in the rollout role (call seconds
    over rollout seconds), largest first: the router's spread without the time a cell spent
    training (under E a cell that trained part of the run serves fewer calls in all, not fewer at
    once). None when an engine's cell is unknown (an engine restarted under a new URL)."""
    busy: dict[str, float] = {}
    for c in calls:
        if c.t_end > c.t_start:
            busy[c.endpoint] = busy.get(c.endpoint, 0.0) + (c.t_end - c.t_start)
    if not busy or any(url_cell.get(ep) not in rollout_s or rollout_s[url_cell[ep]] <= 0 for ep in busy):
        return None
    return sorted((b / rollout_s[url_cell[ep]] for ep, b in busy.items()), reverse=True)


def decode_vs_spec_calls(calls) -> dict:
    """How the live calls kept to the paced spec, per engine endpoint: for each call, the tokens the
    spec says it would have decoded over its lifetime at the load its engine had (calls in flight
    there and their mean context, step by step), over the tokens it did decode. 1 = exactly as the
    spec; above 1 = slower (per-call overheads: proxy, HTTP, the prefill round, steps whose compute
    overran the pace on the loaded CPU). Per endpoint too (the gate reads the worst engine). Also
    how evenly the router spread the calls: calls per endpoint over the run (what the simulator's
    router_spread is fed), and the busiest engine's calls in flight over the mean of the engines
    with calls in flight, time-weighted (the spread at each instant: a cell that trained part of
    the run serves fewer calls in all without being less loaded while it serves).
    `calls`: objects with endpoint, t_start, t_end, n_input, n_output (the recorded calls)."""
    import bisect

    by: dict[str, list] = {}
    for c in calls:
        if c.t_end > c.t_start:
            by.setdefault(c.endpoint, []).append(c)
    ratios, counts, per_endpoint = [], [], {}
    for ep, cs in sorted(by.items()):
        counts.append(len(cs))
        ev = sorted([(c.t_start, 1, c.n_input + c.n_output / 2) for c in cs] +
                    [(c.t_end, -1, c.n_input + c.n_output / 2) for c in cs])
        ts, rate, n, ctx = [], [], 0, 0.0  # segment starts and the spec's tokens/s of one call there
        for t, d, x in ev:
            n += d
            ctx += d * x
            ts.append(t)
            rate.append(1.0 / PACED_REPLICA.step_s(n, ctx / n) if n > 0 else 0.0)
        mine = []
        for c in cs:
            i = max(0, bisect.bisect_right(ts, c.t_start) - 1)
            got = 0.0
            while i < len(ts) and ts[i] < c.t_end:
                a, b = max(ts[i], c.t_start), min(ts[i + 1] if i + 1 < len(ts) else c.t_end, c.t_end)
                got += max(0.0, b - a) * rate[i]
                i += 1
            mine.append(got / max(1, c.n_output))
        ratios += mine
        per_endpoint[ep] = statistics.fmean(mine)
    mean_calls = statistics.fmean(counts) if counts else 0.0
    return {"decode_spec_tokens_per_token": statistics.fmean(ratios) if ratios else None,
            "decode_spec_worst_engine": max(per_endpoint.values()) if per_endpoint else None,
            "decode_spec_by_engine": sorted((round(v, 4) for v in per_endpoint.values()), reverse=True),
            "calls_per_endpoint": sorted(counts, reverse=True),
            "busiest_endpoint_over_mean": max(counts) / mean_calls if counts else None,
            "busiest_inflight_over_mean": busiest_inflight_over_mean(by)}


def busiest_inflight_over_mean(by: dict[str, list]) -> float | None:
    """Time-weighted busiest engine's calls in flight over the mean of the engines that have any:
    integral of max_i n_i(t) over integral of mean_i n_i(t) (engines with n_i(t) > 0)."""
    ev = sorted([(c.t_start, 1, ep) for ep, cs in by.items() for c in cs] +
                [(c.t_end, -1, ep) for ep, cs in by.items() for c in cs])
    n: dict[str, int] = {}
    top = mean = 0.0
    for (t, d, ep), nxt in zip(ev, ev[1:] + [None]):
        n[ep] = n.get(ep, 0) + d
        if nxt is None:
            break
        busy = [k for k in n.values() if k > 0]
        dt = nxt[0] - t
        if busy and dt > 0:
            top += max(busy) * dt
            mean += sum(busy) / len(busy) * dt
    return top / mean if mean > 0 else None


def write_trace(rows: list[dict], path: Path) -> Path:
    from gyre.sim.workload import read_trace

    cols = ["execution_id", "group", "duration_s", "calls", "tokens", "train_tokens", "context_tokens",
            "output_tokens", "tool_s"]
    path.write_text(json.dumps({"executions": [{k: r[k] for k in cols} for r in rows]}, indent=0))
    read_trace(path)  # the simulator's own check of the schema
    return path


def measured_rates(report: dict, run_dir: Path, rows: list[dict]) -> dict:
    ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines() if line.strip()]
    trained = {d["execution"] for d in ledger if d.get("admitted")}
    toks = {r["execution_id"]: r["train_tokens"] for r in rows}
    busy_train = sum(c["busy_train_s"] for c in report["cells"])
    sw = [p for c in report["cells"] for p in c["switch_phases"] if p.get("ok")]
    # evaluation delay: a step starts when its first group is admitted, i.e. evaluated in full; that
    # group's last execution ended at min over the step's groups of their last end
    t0 = min(iv[1] for ivs in report["intervals"].values() for iv in ivs)
    step_of = {d["group"]: d["step"] for d in ledger if d.get("admitted")}
    group_end: dict[int, float] = {}
    for r in rows:
        g = int(r["group"])
        group_end[g] = max(group_end.get(g, 0.0), r["t_end"])
    lags = []
    for st in report["steps"]:
        ends = [e for g, e in group_end.items() if step_of.get(g) == st["step"]]
        if ends:
            lags.append(st["t_start"] + t0 - min(ends))
    durs = [r["duration_s"] for r in rows]
    return {**decode_vs_spec(run_dir, report),
        "executions": len(rows), "trained_executions": len(trained),
        "train_tokens_per_s": sum(toks.get(e, 0.0) for e in trained) / busy_train if busy_train else None,
        "busy_train_s": busy_train, "busy_rollout_s": sum(c["busy_rollout_s"] for c in report["cells"]),
        "to_train_s": _med([p["wall_s"] for p in sw if p["to"] == "train"]),
        "to_rollout_s": _med([p["wall_s"] for p in sw if p["to"] == "rollout"]),
        "push_s": _med([st["push_s"] for st in report["steps"]]),
        "opt_s": _med([st["reduce_s"] for st in report["steps"]]),
        "eval_s": max(0.0, _med(lags)), "eval_lags_s": [_r(x, 3) for x in lags],
        "mean_duration_s": statistics.fmean(durs), "max_duration_s": max(durs),
        "mean_tool_s": statistics.fmean(r["tool_s"] for r in rows),
        "mean_model_s": statistics.fmean(r["model_s"] for r in rows),
        "mean_output_tokens": statistics.fmean(r["output_tokens"] for r in rows),
        "mean_context_tokens": statistics.fmean(r["context_tokens"] for r in rows) / 2,
        "mean_unique_tokens": statistics.fmean(r["tokens"] for r in rows),
    }


# ---- simulation ----------------------------------------------------------------------------------
def kv_tokens() -> int:
    from gyre.config import default_tiny_dir, load_config
    from gyre.model.spec import read_spec
    from gyre.model.tiny import ensure_tiny_model

    s = read_spec(Path(ensure_tiny_model(default_tiny_dir(load_config(None, [])))))
    return prefix_cache_tokens(PREFIX_CACHE_MB, s.layers, s.kv_heads, s.head_dim)


def cluster_from(rates: dict, decode_factor: float = 1.0):
    """The cluster model of a live run: the paced spec, that run's measured rates. `decode_factor`
    (a diagnostic, not the headline) stretches every decode step by that factor (bandwidth / f,
    overhead x f), e.g. by how much slower than the spec the live calls decoded."""
    from dataclasses import replace

    from gyre.sim.cost_model import ClusterModel

    replica = PACED_REPLICA if decode_factor == 1.0 else replace(
        PACED_REPLICA, hbm_tb_s=PACED_REPLICA.hbm_tb_s / decode_factor,
        overhead_ms=PACED_REPLICA.overhead_ms * decode_factor)
    return ClusterModel(nodes=CELLS, cell_nodes=1, gpus_per_node=PACED_REPLICA.gpus, replica=replica,
                        train_tokens_per_s=rates["train_tokens_per_s"], to_train_s=rates["to_train_s"],
                        to_rollout_s=rates["to_rollout_s"], push_s=rates["push_s"], eval_s=rates["eval_s"],
                        opt_s=rates["opt_s"], kv_tokens_per_replica=kv_tokens())


def simulate_scheme(scheme: str, split: int, cluster, trace: Path, spread: tuple = ()):
    """The live run's policy (same config, same hints) on the cluster model and the trace;
    `spread`: the router's calls per endpoint (SimSpec.router_spread), () = the even pool."""
    from gyre.config import load_config
    from gyre.sched import RunSpec
    from gyre.sim.simulator import SimSpec, simulate
    from gyre.sim.workload import Workload

    cfg = load_config(str(CONFIG), [*common(), *scheme_overrides(scheme, split)])
    sim = SimSpec(segments=CALLS, tick_s=0.1, record=False, router_spread=tuple(spread))
    return simulate(RunSpec.from_config(cfg), Workload.from_trace(trace), cluster, sim)


def ranking(times: dict) -> list[str]:
    return sorted(times, key=lambda s: times[s])



def analyse(name: str, scheme: str, split: int, run_dir: Path, report: dict, trace_path: Path) -> tuple[dict, dict, Path]:
    """One live run: its rates, its trace, the gate's verdict and its simulations (the router's
    spread fed in; the even pool; decode stretched as measured, a diagnostic). Returns (record,
    rates, trace)."""
    rows = trace_rows(run_dir)
    rates = measured_rates(report, run_dir, rows)
    trace = write_trace(rows, trace_path)
    live = report["wall_s"]
    record = {"name": name, "scheme": scheme, "split": split, "live_s": live, "gate": gate(rates),
              # training's share of cell time: busy training seconds over cells x the loop's wall time
              "train_share": rates["busy_train_s"] / (CELLS * live) if live else None,
              # ... and over the busy seconds of both roles (idle time left out: A's fixed pools idle)
              "train_share_of_busy": rates["busy_train_s"] / (rates["busy_train_s"] + rates["busy_rollout_s"])
              if rates["busy_train_s"] + rates["busy_rollout_s"] else None,
              "train_pace_ratio": (rates["train_tokens_per_s"] or 0.0) / TRAIN_PACE_TOKENS_PER_S,
              **{k: v for k, v in rates.items() if k != "eval_lags_s"}}
    spread = tuple(rates["serving_load_per_endpoint"] or rates["calls_per_endpoint"])
    record["router_spread_fed"] = "serving_load_per_endpoint" if rates["serving_load_per_endpoint"] else \
        "calls_per_endpoint"
    sim = simulate_scheme(scheme, split, cluster_from(rates), trace, spread)
    even = simulate_scheme(scheme, split, cluster_from(rates), trace)
    stretched = simulate_scheme(scheme, split, cluster_from(rates, rates["decode_spec_tokens_per_token"]), trace,
                                spread)
    record.update({"sim_s": sim.makespan_s, "sim_s_even": even.makespan_s, "sim_over_live": sim.makespan_s / live,
                   "sim_even_over_live": even.makespan_s / live,
                   "sim_over_live_decode_as_measured": stretched.makespan_s / live,
                   "live_switches": sum(c["switches"] for c in report["cells"]),
                   "sim_switches": sum(c["switches"] for c in sim.cell_stats),
                   "live_step_end_s": [_r(x["t_end"], 2) for x in report["steps"]],
                   "sim_step_end_s": [_r(x["t_end"], 2) for x in sim.step_stats],
                   "eval_lags_s": rates["eval_lags_s"]})
    return record, rates, trace


def main() -> int:
    global STEPS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    ap.add_argument("--half", action="store_true", help="also run A at the half split live (if it differs)")
    ap.add_argument("--reuse", help="analyse the runs of an earlier --keep run in DIR instead of running")
    ap.add_argument("--steps", type=int, default=STEPS, help=f"optimizer steps per run (default {STEPS})")
    ap.add_argument("--repeats", type=int, default=REPEATS, help=f"repeats of every scheme (default {REPEATS})")
    ap.add_argument("--retries", type=int, default=RETRIES,
                    help=f"runs again a scheme the gate rejected, this many times per repeat (default {RETRIES})")
    ap.add_argument("--only", choices=("E",), help="run E once only (a smoke check of the setup)")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    if args.repeats < 1 or args.retries < 0 or args.steps < 1:
        ap.error("--repeats and --steps must be >= 1 and --retries >= 0")
    STEPS = args.steps
    t_all = time.perf_counter()
    load_before = os.getloadavg()
    base = Path(args.reuse) if args.reuse else Path(tempfile.mkdtemp(prefix="gyre-bench-live-sched-"))
    half = max(1, CELLS // 2)
    runs: list[dict] = []
    names = ["E", "A", "C"]
    split_s: dict = {}
    best = 0
    try:
        print(f"bench_live_sched: runs under {base}", flush=True)

        def live(repeat: int, name: str, scheme: str, split: int = 0) -> dict:
            """Run (or reread) `name` of this repeat until the gate passes or the retries are spent;
            every attempt is recorded."""
            for attempt in range(args.retries + 1):
                d = base / f"r{repeat}-{name}-{attempt}"
                if args.reuse:
                    if not (d / "report.json").exists():
                        if attempt == 0:
                            raise SystemExit(f"bench_live_sched: --reuse {base}: {d}/report.json is missing; "
                                             "give the directory an earlier --keep run printed")
                        break
                    report = json.loads((d / "report.json").read_text())
                    meta = json.loads((d.parent / f"{d.name}.meta.json").read_text()) \
                        if (d.parent / f"{d.name}.meta.json").exists() else {}
                else:
                    load0 = os.getloadavg()[0]
                    report, took = run_live(d.name, scheme_overrides(scheme, split), d)
                    meta = {"gyre_run_s": _r(took, 1), "gyre_run_rc": report["gyre_run_rc"], "load_avg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)]}
                    (d.parent / f"{d.name}.meta.json").write_text(json.dumps(meta))
                rec, rates, trace = analyse(name, scheme, split, d, report, base / f"{d.name}_trace.json")
                rec.update(repeat=repeat, attempt=attempt, **meta)
                runs.append(rec)
                verdict = "passed" if rec["gate"]["passed"] else f"REJECTED: {rec['gate']['why']}"
                print(f"  r{repeat} {name} attempt {attempt}: live {rec['live_s']:.1f} s, sim {rec['sim_s']:.1f} s, "
                      f"train share {rec['train_share']:.2f}, gate {verdict}", flush=True)
                if rec["gate"]["passed"]:
                    break
            return rec | {"_rates": rates, "_trace": trace}

        if args.only:
            rec = live(0, "E", "E")
            print(json.dumps({k: v for k, v in rec.items() if not k.startswith("_")}, indent=1, default=str))
            return 0
        for repeat in range(args.repeats):
            e = live(repeat, "E", "E")
            if repeat == 0:  # Async's split, searched once in the simulator with the first E run's rates
                split_s = {k: simulate_scheme("A", k, cluster_from(e["_rates"]), e["_trace"]).makespan_s
                           for k in range(1, CELLS)}
                best = min(split_s, key=lambda k: (split_s[k], k))
            live(repeat, "A", "A", best)
            if args.half and half != best:
                live(repeat, "A_half", "A", half)
            live(repeat, "C", "C")
        if args.half and half != best:
            names.insert(2, "A_half")
    finally:
        if not args.keep and not args.reuse:
            shutil.rmtree(base, ignore_errors=True)
    agg = aggregate(runs, names)
    passed = all(agg[f"accepted_{n}"] >= args.repeats for n in names)
    result = {
        "engine_paced": True, "train_paced": True, "train_pace_tokens_per_s": TRAIN_PACE_TOKENS_PER_S,
        "paced_replica": {k: getattr(PACED_REPLICA, k) for k in ("gpus", "hbm_tb_s", "dense_gb", "kv_bytes_per_token",
                                                                "overhead_ms", "active_params", "peak_tflops",
                                                                "prefill_mfu")},
        "paced_step_ms_batch1_ctx300": _r(PACED_REPLICA.step_s(1, 300) * 1e3, 3),
        "paced_step_ms_batch10_ctx300": _r(PACED_REPLICA.step_s(10, 300) * 1e3, 3),
        "cells": CELLS, "staleness": STALENESS, "steps": STEPS, "groups_per_step": GROUPS, "group_size": GROUP_SIZE,
        "concurrent_executions": GROUPS * GROUP_SIZE, "calls_per_execution": CALLS, "max_tokens_per_call": MAX_TOKENS,
        "tool_mean_s_per_call": TOOL_MEAN_S, "tool_sigma_task": SIGMA_TASK, "tool_sigma_exec": SIGMA_EXEC, "seed": SEED,
        "harness": "gyre.harness.long_tail_agent", "suite": "benchmarks/live_sched_suite",
        "repeats": args.repeats, "retries_per_repeat": args.retries,
        "gate_tolerance": GATE_TOLERANCE, "gate_passed": passed,
        **agg,
        "within_10pct": all(agg[f"sim_over_live_{n}"] is not None and abs(agg[f"sim_over_live_{n}"] - 1) <= 0.10
                            for n in ("E", "A", "C")),
        "async_split": best, "async_half_split": half,
        "sim_async_split_s": {str(k): _r(v, 2) for k, v in split_s.items()},
        "runs": [{k: (_r(v) if isinstance(v, float) else v) for k, v in r.items()} for r in runs],
        "load_avg_before": [round(x, 2) for x in load_before], "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        "cpu_cores": os.cpu_count(),
        "bench_wall_s": round(time.perf_counter() - t_all, 1),
        "notes": [
            "the embedded engine was PACED (engine.pace = true): each decode step lasts PACED_REPLICA's roofline "
            "step time for its batch (gyre/engine/pace.py), a scaled replica, not a GPU; prefill is the tiny "
            "model's real CPU prefill",
            f"the trainer was PACED (train.pace_tokens_per_s = {TRAIN_PACE_TOKENS_PER_S}, gyre/train/pace.py): each "
            "micro-batch lasts at least its tokens at that rate per cell, so training is a real share of cell time "
            "(train_share_*: busy training seconds over cells x live_s) and k training cells train k times as fast, "
            "as the simulator assumes; reduce, optimizer step and export are not paced; train_pace_ratio = measured "
            "training tokens per busy cell-second over the pace",
            "live_s_* = the head's loop wall time (report.json wall_s: cells up to the last step committed); "
            "sim_s_* = the simulator's makespan for the same steps with the router's measured spread "
            "(SimSpec.router_spread = that run's serving_load_per_endpoint: each engine's mean calls in flight "
            "while its cell served; calls_per_endpoint if a cell is unknown, router_spread_fed says which; each "
            "execution on one lane, a lane decodes at its own calls' batch); sim_s_even_* = the same with the "
            "even pool (the simulator's default)",
            "every figure is the median over the accepted repeats; *_min, *_max and *_runs give the spread; "
            "ranking_* rank the medians; repeats_live_ranking_as_medians / repeats_sim_ranking_matches_live count "
            "the complete repeats whose own ranking agrees; every repeat uses the same seed (the same executions), "
            "so repeats measure the machine's run-to-run noise, not the workload's",
            f"the gate: a run is rejected (recorded in runs and rejections, not used) when one engine's calls "
            f"decoded more than {GATE_TOLERANCE:.0%} slower than the paced spec at that engine's own load "
            "(decode_spec_worst_engine): the CPU could not keep the pace; a rejected scheme is run again up to "
            "retries_per_repeat times",
            "simulator inputs per run, from that run alone: its executions as a trace (calls, output tokens, "
            "unique tokens, context, tool time = wall minus model-call time), switch times, push_s, opt_s, eval_s, "
            "training tokens per cell-second, calls per endpoint; decode from the paced spec; the policy is "
            "RunSpec.from_config of the live config (same hints both sides); the sim re-decides every 0.1 s; "
            "Async's split was searched once, in the simulator, on the first E run",
            "calls_per_endpoint counts a cell's calls over the whole run, so under E a cell that trained part of "
            "the run looks less loaded; serving_load_per_endpoint divides each engine's call seconds by its "
            "cell's rollout seconds instead; busiest_inflight_over_mean is the instantaneous spread (time-weighted "
            "busiest engine's calls in flight over the mean of the engines with calls in flight)",
            f"the machine has {os.cpu_count()} cores shared with other users (load averages per run in runs)",
        ],
    }
    out = Path(args.out)
    if not passed:  # the recorded result stays as it was; the attempt is kept for the record
        out = Path(tempfile.gettempdir()) / "live_sched_rejected.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items()
                      if k.startswith(("live_s", "sim_s", "sim_over", "train_share", "ranking", "repeats_", "runs_"))
                      and not k.endswith("_runs")}, indent=1))
    print(f"wrote {out}" + ("" if passed else " (the gate rejected runs: benchmarks/results is left as it was)"))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
