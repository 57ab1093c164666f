"""`make bench-nl2repo`: the paper's NL2RepoBench comparison in Gyre's physical cluster model.

Decode is a roofline per serving replica, prefill FLOP-bound, KV capacity from HBM left after the
weights (gyre/sim/roofline.py, calibration.py: every number with its source). Two unknowns the
paper does not state, groups per step (G) and how many tokens a trained execution costs
(train_cost f, x 700K), are pinned only by its secondary figures:

- the 1.93 h profile pins the tool time per execution at each G (tokens fix the model time);
- the slack is linear in f at a given G (training work grows with f, the rollout window's spare
  capacity does not), so one run at f = 1 gives the f band that meets it; each band's edges and
  middle are then run in both layouts;
- "rollout masks training with 20.85% slack" (E0, 8 cells x 4 nodes): slack = 1 - the step's
  training cell-seconds / the rollout side's spare cell-seconds in the step's rollout window;
- "8 x 4 vs 4 x 8 within 2.2%": E0 hours with cells of 4 and of 8 nodes on the same 32 nodes.

The grid points that meet all three form `consistent_family`; the A/E and C/E ratios predicted
over it (`predicted_ratios`, min/median/max, Async at its best split) are then compared with the
held-out headline figures (75.42 / 134.55 / 91.47 h, E0 vs C2), which are never used to choose a
parameter. Writes benchmarks/results/nl2repo.json, nl2repo.md and regime_map.png (+ Gantt charts).

    python benchmarks/bench_nl2repo.py            # everything (about 10 minutes on 2 cores)
    python benchmarks/bench_nl2repo.py --quick    # a coarse grid and short runs (a smoke test)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from gyre.fsio import atomic_write_text
from gyre.report import plots
from gyre.sim import calibration as cal
from gyre.sim.scenario import PAPER, Scenario, best_async, pin_tool_time

OUT = Path(__file__).resolve().parent / "results"
SLACK, SLACK_TOL = 0.2085, 0.05     # paper: 20.85% slack; accepted band +- 5 points (simulation noise)
GAP, GAP_TOL = 0.022, 0.01          # paper: 8x4 vs 4x8 within 2.2%; + 1 point
PROFILE_QUERY_H, PROFILE_TOL = 2.96, 0.12
GRID_G = (16, 32, 64, 128, 192, 256, 384, 512)
MAP_G = (16, 64, 256)
MAP_F = (1, 4, 16)
FAMILY_STEPS, RATIO_STEPS = 6, 4


def _pool(fn, jobs, procs):
    if procs > 1 and len(jobs) > 1:
        with mp.get_context("fork").Pool(procs) as pool:
            return pool.map(fn, jobs, chunksize=1)
    return [fn(j) for j in jobs]


def _workload(p: cal.Preset, tool_s: float, f: float):
    return replace(p.workload, mean_tool_s=tool_s, train_cost=f)


# ---- the family: secondary figures only ----------------------------------------------------------
def _pin(job) -> tuple[int, float]:
    name, g, steps = job
    p = cal.preset(name).with_(groups_per_step=g)
    return g, pin_tool_time(p, steps=steps)[0]


def _slack_band(job) -> tuple[int, list[float]]:
    """f at the slack band's edges and centre for this G, from one E0 run at f = 1."""
    name, g, tool, steps = job
    p = cal.preset(name)
    r = Scenario("E", 0, p.cluster(), workload=_workload(p, tool, 1.0), steps=steps, groups_per_step=g,
                 record=False).run()
    per_f = max(1e-9, 1.0 - r.slack)  # share of the spare capacity one unit of f uses
    return g, [round((1 - x) / per_f, 2) for x in (SLACK + SLACK_TOL, SLACK, SLACK - SLACK_TOL)]


def _family_point(job) -> dict:
    name, g, f, tool, steps = job
    p = cal.preset(name)
    wl = _workload(p, tool, f)
    r = {}
    for cn in (4, 8):
        r[cn] = Scenario("E", 0, p.cluster(cell_nodes=cn), workload=wl, steps=steps, groups_per_step=g,
                         record=False).run()
    a, b = r[4], r[8]
    gap = b.makespan_s / a.makespan_s - 1
    ok_slack = abs(a.slack - SLACK) <= SLACK_TOL
    ok_gap = abs(gap) <= GAP + GAP_TOL
    ok_profile = abs(a.mean_query_h / PROFILE_QUERY_H - 1) <= PROFILE_TOL
    return {"groups_per_step": g, "train_cost": f, "mean_tool_s": round(tool), "slack": round(a.slack, 4),
            "gap_4x8_vs_8x4": round(gap, 4), "mean_rollout_h": round(a.mean_rollout_h, 3),
            "mean_query_h": round(a.mean_query_h, 3), "query_ge_4h_share": round(a.query_ge_4h_share, 4),
            "model_wait_share": round(a.model_wait_share, 3), "mean_batch": round(a.mean_batch, 2),
            "e0_hours": round(a.hours, 2), "consistent": ok_slack and ok_gap and ok_profile,
            "meets": {"slack": ok_slack, "gap": ok_gap, "profile": ok_profile}}


# ---- ratios at a point: E, C and Async's best split, at matched staleness ------------------------
def _ratios(job) -> dict:
    name, g, f, tool, steps, nodes = job
    p = cal.preset(name)
    wl = _workload(p, tool, f)
    out = {"groups_per_step": g, "train_cost": f, "nodes": nodes}
    for k in (0, 2):
        s = Scenario("E", k, p.cluster(nodes=nodes), workload=wl, steps=steps, groups_per_step=g, record=False)
        e, c = s.run(), s.with_(scheme="C").run()
        best, by = best_async(s) if s.cluster.cells > 1 else (None, {})
        out[f"E{k}"], out[f"C{k}"] = round(e.hours, 3), round(c.hours, 3)
        out[f"C{k}/E{k}"] = round(c.hours / e.hours, 4)
        if best is not None:
            half = by[max(1, s.cluster.cells // 2)]
            out.update({f"A{k}": round(best.hours, 3), f"A{k}_split": best.async_rollout_cells,
                        f"A{k}_half": round(half, 3), f"A{k}/E{k}": round(best.hours / e.hours, 4),
                        f"A{k}_half/E{k}": round(half / e.hours, 4)})
        else:
            out[f"A{k}"] = None
            out[f"A{k}_skipped"] = "async needs >= 2 cells"
    return out


def _spread(xs: list[float]) -> dict:
    return {"min": round(min(xs), 3), "median": round(statistics.median(xs), 3), "max": round(max(xs), 3),
            "n": len(xs)} if xs else {"min": None, "median": None, "max": None, "n": 0}


# ---- the like-for-like runs at a preset's point ----------------------------------------------------
RUNS = [("E", 0, 1), ("C", 0, 1), ("A", 0, 1), ("E", 2, 1), ("C", 2, 1), ("A", 2, 1),
        ("E-paper", 0, 1), ("E-paper", 2, 1), ("E", 0, 4), ("C", 0, 4), ("A", 0, 4)]


def _run(job):
    name, scheme, k, b, g, f, tool, steps = job
    p = cal.preset(name)
    s = Scenario(scheme, k, p.cluster(), workload=_workload(p, tool, f), steps=steps, groups_per_step=g,
                 steps_per_sync=b, preset=p.name)
    if scheme == "A":
        best, by = best_async(s)
        return best, by
    return s.run(), {}


def _label(r, b: int) -> str:
    """The policy's own label, with the burst size where there is one."""
    return r.label + (f" b{b}" if b > 1 else "")


def run_row(r, by_split: dict, b: int) -> dict:
    lag = r.lag
    half = by_split.get(max(1, r.cells // 2)) if by_split else None
    return {"preset": r.preset, "label": _label(r, b), "scheme": r.scheme,
            "staleness": r.staleness, "steps_per_sync": b, "nodes": r.nodes, "cell_size": r.cell_size,
            "hours": round(r.hours, 2), "bound_hours": round(r.lower_bound_hours, 2),
            "gpu_hours": round(r.gpu_hours("rollout", "train", "switch", "idle"), 0),
            "mean_rollout_h": round(r.mean_rollout_h, 3), "mean_query_h": round(r.mean_query_h, 3),
            "model_wait_share": round(r.model_wait_share, 3), "mean_batch": round(r.mean_batch, 2),
            "slack": None if r.slack is None else round(r.slack, 4), "evictions": r.evictions,
            "reprefills": r.reprefills,
            "best_async_split": r.async_rollout_cells if r.scheme == "A" else None,
            "async_half_hours": round(half, 2) if half else None,
            "async_hours_by_split": {str(k): round(v, 2) for k, v in by_split.items()} or None,
            "lag_group_mean_steps": round(lag["group_mean_steps"], 3), "lag_worst_steps": lag["worst_steps"],
            "lag_worst_syncs": lag["worst_syncs"], "dropped": r.dropped_groups,
            "trainer_idle_share": round(r.trainer_idle_share, 3),
            "rollout_idle_share": round(r.rollout_idle_share, 3),
            "switches": sum(c["switches"] for c in r.cell_stats)}


# ---- report ------------------------------------------------------------------------------------------
def regime_map_png(points: list[dict], family: list[dict], path: Path) -> None:
    """A/E (best split) and C/E over groups per step x training cost, at staleness 0 and 2; points
    consistent with the paper's secondary figures drawn as stars."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fam = {(p["groups_per_step"], p["train_cost"]) for p in family if p["consistent"]}
    fig, axes = plt.subplots(2, 2, figsize=(11, 8.5))
    for col, k in enumerate((0, 2)):
        for row, (num, title) in enumerate(((f"A{k}", f"best-split Async / Elastic, staleness {k}"),
                                            (f"C{k}", f"Colocate / Elastic, staleness {k}"))):
            ax = axes[row][col]
            pts = [p for p in points if p.get(num) is not None]
            xs = [p["groups_per_step"] for p in pts]
            ys = [p["train_cost"] for p in pts]
            vs = [p[num] / p[f"E{k}"] for p in pts]
            star = [(p["groups_per_step"], p["train_cost"]) in fam for p in pts]
            sc = ax.scatter(xs, ys, c=vs, s=[260 if st else 160 for st in star], cmap="viridis",
                            marker="s", vmin=min(vs + [1.0]), vmax=max(vs + [1.0]))
            for x, y, v, st in zip(xs, ys, vs, star):
                ax.annotate(f"{v:.2f}" + (" ★" if st else ""), (x, y), textcoords="offset points", xytext=(0, 11),
                            ha="center", fontsize=8, fontweight="bold" if st else "normal")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log", base=2)
            ax.set_xlabel("groups per step (x 8 rollouts)")
            ax.set_ylabel("training cost per execution (x 700K tokens)")
            ax.set_title(title, fontsize=10)
            fig.colorbar(sc, ax=ax, shrink=0.8)
    fig.suptitle("nl2repo-122b, 32 nodes = 8 cells x 4 (simulated). ★ = consistent with the paper's secondary "
                 "figures (slack 20.85%, 8x4 vs 4x8 within 2.2%, 1.93 h profile)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _f3(x) -> str:
    return "–" if x is None else f"{x:.3f}"


def markdown(doc: dict) -> str:
    md = ["# NL2RepoBench scheduling comparison (simulated, physical cluster model)", "",
          "`make bench-nl2repo`. Decode: roofline per replica; KV capacity from HBM; unknowns pinned only by "
          "the paper's secondary figures; the headline hours are held out. Async at its best split "
          "(and the half split beside it).", "",
          "## Family consistent with the secondary figures", "",
          f"Criteria: slack {SLACK:.2%} ± {SLACK_TOL:.0%} (E0, 8x4), |E0 4x8 / 8x4 - 1| ≤ {GAP + GAP_TOL:.1%}, "
          f"mean query within {PROFILE_TOL:.0%} of 2.96 h (tool time pinned to the 1.93 h mean at each G).", "",
          "| G | f | tool s | slack | gap 4x8/8x4 | rollout h | query h | ≥4 h | model wait | batch | consistent |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in doc["family_grid"]:
        md.append(f"| {p['groups_per_step']} | x{p['train_cost']:g} | {p['mean_tool_s']} | {p['slack']:.3f} "
                  f"| {p['gap_4x8_vs_8x4']:+.3f} | {p['mean_rollout_h']:.2f} | {p['mean_query_h']:.2f} "
                  f"| {p['query_ge_4h_share']:.1%} | {p['model_wait_share']:.0%} | {p['mean_batch']:.1f} "
                  f"| {'**yes**' if p['consistent'] else 'no'} |")
    fam = doc["consistent_family"]
    md += ["", f"Consistent: G {fam['groups_per_step']}, f {fam['train_cost']}, tool time {fam['mean_tool_s']} s.", "",
           "## Predicted ratios over the family (Async at its best split)", "",
           "| ratio | min | median | max | n |", "|---|---|---|---|---|"]
    for k, v in doc["predicted_ratios"].items():
        md.append(f"| {k} | {v['min']} | {v['median']} | {v['max']} | {v['n']} |")
    md += ["", "## Regime map (8 cells x 4 nodes)", "", "![regime map](regime_map.png)", "",
           "| G | f | A0/E0 | C0/E0 | A2/E2 | C2/E2 | A0 split | A2 split | half-split A0/E0 |",
           "|---|---|---|---|---|---|---|---|---|"]
    for p in doc["regime_map"]:
        md.append(f"| {p['groups_per_step']} | x{p['train_cost']:g} | {p.get('A0/E0')} | {p['C0/E0']} "
                  f"| {p.get('A2/E2')} | {p['C2/E2']} | {p.get('A0_split')} | {p.get('A2_split')} "
                  f"| {p.get('A0_half/E0')} |")
    md += ["", "## Small GPU budgets (the paper's open question), at the preset's point", "",
           "| nodes | cells | E0 h | C0/E0 | A0/E0 (split) | E2 h | C2/E2 | A2/E2 (split) |",
           "|---|---|---|---|---|---|---|---|"]
    for p in doc["small_budgets"]:
        a0 = f"{p['A0/E0']} ({p['A0_split']})" if p.get("A0") else "–"
        a2 = f"{p['A2/E2']} ({p['A2_split']})" if p.get("A2") else "–"
        md.append(f"| {p['nodes']} | {p['nodes'] // 4} | {p['E0']} | {p['C0/E0']} | {a0} | {p['E2']} | {p['C2/E2']} | {a2} |")
    md += ["", "## Runs at each preset's point", "",
           "| preset | run | hours | bound | rollout / query h | model wait | batch | slack | evictions "
           "| best A split (half: h) | lag mean / worst | trainer idle | switches |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["runs"]:
        split = f"{r['best_async_split']} ({r['async_half_hours']} h)" if r["best_async_split"] else "–"
        md.append(f"| {r['preset']} | {r['label']} | {r['hours']} | {r['bound_hours']} | {r['mean_rollout_h']:.2f} / "
                  f"{r['mean_query_h']:.2f} | {r['model_wait_share']:.0%} | {r['mean_batch']:.1f} | {_f3(r['slack'])} "
                  f"| {r['evictions']} | {split} | {r['lag_group_mean_steps']:.2f} / {r['lag_worst_steps']} "
                  f"| {r['trainer_idle_share']:.0%} | {r['switches']} |")
    md += ["", "## Paper vs Gyre", "", "| claim | paper | Gyre | holds |", "|---|---|---|---|"]
    for c in doc["paper_vs_gyre"]:
        md.append(f"| {c['claim']} | {c['paper']} | {c['gyre']} | {'yes' if c['holds'] else '**no**'} |")
    md += ["", "## Calibration (value · source · fitted on)", "", "| preset | name | value | source | fitted on |",
           "|---|---|---|---|---|"]
    for pname, entries in doc["calibration"].items():
        for k, e in entries.items():
            v = e["value"]
            vs = f"{v:.4g}" if isinstance(v, float) else str(v)
            md.append(f"| {pname} | {k} | {vs} | {e['source']} | {e['fitted_on'] or '–'} |")
    return "\n".join(md) + "\n"


def paper_vs_gyre(runs: list[dict], ratios: dict) -> list[dict]:
    by = {(r["preset"], r["label"]): r for r in runs}
    P, P24 = cal.P122B.name, cal.P2P4T.name
    e0, c2 = by[(P, "E0")], by[(P, "C2")]
    out = [{"claim": "122B, 32 nodes: E0 faster than C2 (held out)", "paper": "E0 < C2",
            "gyre": f"E0 {e0['hours']} h, C2 {c2['hours']} h", "holds": e0["hours"] < c2["hours"]},
           # the family is pinned on short runs: the preset's full run must land in the same band
           {"claim": "122B, 32 nodes: E0 slack of the full run within the pinned band", "paper": "20.85% slack",
            "gyre": f"slack {e0['slack']:.1%} (band {SLACK - SLACK_TOL:.1%}–{SLACK + SLACK_TOL:.1%})",
            "holds": abs(e0["slack"] - SLACK) <= SLACK_TOL}]
    b4 = by[(P, "E0 b4")]
    out.append({"claim": "E0 read as 4 optimizer steps per sync, vs C2 (held out)", "paper": "E0 < C2",
                "gyre": f"E0 b4 {b4['hours']} h, C2 {c2['hours']} h", "holds": b4["hours"] < c2["hours"]})
    for k in (0, 2):
        e, a, c = by[(P24, f"E{k}")], by[(P24, f"A{k}")], by[(P24, f"C{k}")]
        out.append({"claim": f"2.4T, matched staleness {k}: A/E and C/E (held out)",
                    "paper": f"A/E {PAPER['A'] / PAPER['E']:.2f}, C/E {PAPER['C'] / PAPER['E']:.2f}",
                    "gyre": f"A/E {a['hours'] / e['hours']:.2f} (best split {a['best_async_split']}; half "
                            f"{a['async_half_hours'] / e['hours']:.2f}), C/E {c['hours'] / e['hours']:.2f}",
                    "holds": e["hours"] < c["hours"] < a["hours"]})
    for k in (0, 2):
        ae, ce = ratios.get(f"A{k}/E{k}"), ratios.get(f"C{k}/E{k}")
        if ae and ae["n"]:
            # E never slower than Async's best split or Colocate anywhere in the family
            out.append({"claim": f"family's predicted ratios, staleness {k} (122B, 8x4): E fastest at every point",
                        "paper": "up to 1.85 (A/E), 1.78 (C/E)",
                        "gyre": f"A/E {ae['min']}–{ae['max']} (median {ae['median']}), "
                                f"C/E {ce['min']}–{ce['max']} (median {ce['median']})",
                        "holds": ae["min"] >= 1.0 and ce["min"] >= 1.0})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="coarse grid, short runs")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--render", action="store_true", help="only re-render nl2repo.md from nl2repo.json")
    args = ap.parse_args(argv)
    if args.render:
        doc = json.loads((args.out / "nl2repo.json").read_text())
        atomic_write_text(args.out / "nl2repo.md", markdown(doc))
        return 0
    t0 = time.perf_counter()
    P, P24 = cal.P122B.name, cal.P2P4T.name
    grid_g = (16, 64, 256) if args.quick else GRID_G
    fam_steps = 3 if args.quick else FAMILY_STEPS
    ratio_steps = 2 if args.quick else RATIO_STEPS
    run_steps = {P: 4 if args.quick else cal.P122B.steps, P24: 4 if args.quick else 12}

    tools = dict(_pool(_pin, [(P, g, 4) for g in grid_g], args.jobs))
    print(f"tool time pinned to 1.93 h per G: { {g: round(t) for g, t in tools.items()} }", flush=True)
    bands = dict(_pool(_slack_band, [(P, g, tools[g], fam_steps) for g in grid_g], args.jobs))
    family = _pool(_family_point, [(P, g, f, tools[g], fam_steps) for g in grid_g for f in bands[g]], args.jobs)
    consistent = [p for p in family if p["consistent"]]
    for p in family:
        print(f"G {p['groups_per_step']:4} f x{p['train_cost']:<3g} slack {p['slack']:+.3f} gap "
              f"{p['gap_4x8_vs_8x4']:+.3f} query {p['mean_query_h']:.2f} h {'CONSISTENT' if p['consistent'] else ''}",
              flush=True)
    map_pts = {(g, f) for g in MAP_G for f in MAP_F} if not args.quick else {(16, 1), (256, 8)}
    tools.update({g: t for g, t in _pool(_pin, [(P, g, 4) for g in MAP_G if g not in tools], args.jobs)})
    ratio_pts = sorted(map_pts | {(p["groups_per_step"], p["train_cost"]) for p in consistent})
    ratio_rows = _pool(_ratios, [(P, g, f, tools[g], ratio_steps, 32) for g, f in ratio_pts], args.jobs)
    by_pt = {(r["groups_per_step"], r["train_cost"]): r for r in ratio_rows}
    fam_rows = [by_pt[(p["groups_per_step"], p["train_cost"])] for p in consistent]
    predicted = {key: _spread([r[key] for r in fam_rows if r.get(key) is not None])
                 for key in ("A0/E0", "C0/E0", "A2/E2", "C2/E2", "A0_half/E0", "A2_half/E2")}

    # the preset's point: its own G and f (a point of the family; see calibration.py)
    g0, f0 = cal.P122B.groups_per_step, cal.P122B.workload.train_cost
    tool0 = tools.get(g0) or _pin((P, g0, 4))[1]
    small = _pool(_ratios, [(P, g0, f0, tool0, ratio_steps, n) for n in (8, 16, 32)], args.jobs)
    g24, f24 = cal.P2P4T.groups_per_step, cal.P2P4T.workload.train_cost
    tool24 = cal.P2P4T.workload.mean_tool_s  # no profile for 2.4T: the 122B tool time (assumed)
    jobs = [(P, s, k, b, g0, f0, tool0, run_steps[P]) for s, k, b in RUNS] + \
           [(P24, s, k, b, g24, f24, tool24, run_steps[P24]) for s, k, b in RUNS if s != "E-paper"]
    results = _pool(_run, jobs, args.jobs)
    runs = [run_row(r, by, job[3]) for (r, by), job in zip(results, jobs)]
    for r in runs:
        print(f"{r['preset']:18} {r['label']:10} {r['hours']:7.2f} h  slack {_f3(r['slack'])}  evictions "
              f"{r['evictions']}  split {r['best_async_split']}", flush=True)
    calib = {name: cal.calibration(cal.preset(name)) for name in (P, P24)}
    doc = {"benchmark": "nl2repo", "quick": args.quick,
           "paper": {"2.4t_hours": {"E": PAPER["E"], "A": PAPER["A"], "C": PAPER["C"]},
                     "secondary": {"slack": SLACK, "gap_8x4_vs_4x8": GAP, "mean_rollout_h": 1.93,
                                   "mean_query_h": 2.96, "query_ge_4h_share": 0.0951}},
           "criteria": {"slack_tol": SLACK_TOL, "gap_max": GAP + GAP_TOL, "query_tol": PROFILE_TOL,
                        "family_steps": fam_steps, "ratio_steps": ratio_steps},
           "calibration": calib, "tool_s_by_groups_per_step": {str(g): round(t) for g, t in tools.items()},
           "slack_band_train_cost": {str(g): b for g, b in bands.items()},
           "family_grid": family,
           "consistent_family": {
               "groups_per_step": sorted({p["groups_per_step"] for p in consistent}),
               "train_cost": sorted({p["train_cost"] for p in consistent}),
               "mean_tool_s": [min((p["mean_tool_s"] for p in consistent), default=None),
                               max((p["mean_tool_s"] for p in consistent), default=None)],
               "points": [[p["groups_per_step"], p["train_cost"]] for p in consistent]},
           "predicted_ratios": predicted, "regime_map": [by_pt[pt] for pt in sorted(map_pts)],
           "small_budgets": small, "runs": runs}
    doc["paper_vs_gyre"] = paper_vs_gyre(runs, predicted)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "nl2repo.json", json.dumps(doc, indent=1, default=float))
    atomic_write_text(args.out / "nl2repo.md", markdown(doc))
    regime_map_png(ratio_rows, family, args.out / "regime_map.png")
    by = {(r.preset, run_row(r, {}, job[3])["label"]): r for (r, _), job in zip(results, jobs)}
    for key, fname in (((P, "E0"), "gantt_E0.png"), ((P, "C2"), "gantt_C2.png"), ((P, "A2"), "gantt_A2.png"),
                       ((P24, "E0"), "gantt_2.4t_E0.png")):
        if key in by:
            plots.gantt(by[key], args.out / fname)
    for c in doc["paper_vs_gyre"]:
        print(f"{c['claim']}: {c['gyre']} -> {'holds' if c['holds'] else 'does NOT hold'}")
    print(f"consistent family: {doc['consistent_family']}; predicted {predicted}")
    print(f"wrote {args.out}/nl2repo.json, nl2repo.md, regime_map.png in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
