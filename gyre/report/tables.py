"""Markdown tables of simulated runs, with the paper's figures beside Gyre's."""

from __future__ import annotations

from gyre.sim.result import SimResult


def _fmt(x: float | None, nd: int = 2) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def comparison_table(runs: list[SimResult], paper: dict[str, float | None]) -> str:
    """One row per run: paper hours (where the paper reports that run), Gyre hours, bound, shares."""
    head = ("| run | paper (h) | Gyre sim (h) | lower bound (h) | × bound | utilisation | switches "
            "| GPU-h wasted | staleness mean / token-mean / max | not admitted | rollout / query (h) |")
    lines = [head, "|" + "---|" * 11]
    for r in runs:
        d = r.to_dict()
        st = r.step_stats
        g = sum(s.staleness_group_mean for s in st) / len(st)
        t = sum(s.staleness_token_mean for s in st) / len(st)
        m = max(s.staleness_max for s in st)
        na = sum(r.not_admitted.values())
        lines.append(f"| {r.label} | {_fmt(paper.get(r.label))} | {r.hours:.2f} | {r.lower_bound_hours:.2f} "
                     f"| {r.makespan_s / r.lower_bound_s:.3f} | {r.utilisation:.1%} | {d['switches']} "
                     f"| {d['gpu_hours_wasted']:.0f} | {g:.2f} / {t:.2f} / {m} | {na} "
                     f"| {r.mean_rollout_h:.2f} / {r.mean_query_h:.2f} |")
    return "\n".join(lines)


def speedup_table(pairs: list[tuple[str, str, float | None, float]]) -> str:
    """(faster, slower, paper ratio or None, Gyre ratio) rows."""
    lines = ["| comparison | paper | Gyre sim |", "|---|---|---|"]
    for a, b, p, g in pairs:
        lines.append(f"| {a} vs {b} | {_fmt(p)}× | {g:.2f}× |" if p is not None
                     else f"| {a} vs {b} | – | {g:.2f}× |")
    return "\n".join(lines)
