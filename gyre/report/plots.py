"""Role Gantt charts and utilisation plots (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from gyre.events import BUCKETS  # noqa: E402

# `result` below is a simulated run's result (gyre.sim.result.SimResult): read by its attributes,
# never imported, so that the report depends on neither driver (docs/architecture.md).

ROLE_COLOURS = {"rollout": "#4C72B0", "train": "#DD8452", "to_train": "#C44E52",
                "to_rollout": "#8172B3", "failed": "#333333"}
BUCKET_COLOURS = {"rollout": "#4C72B0", "train": "#DD8452", "switch": "#C44E52", "idle": "#BBBBBB"}


def gantt(result, path: str | Path, hours: float | None = None) -> Path:
    """Cell roles over time, one row per cell; `hours` limits the x axis (None = whole run)."""
    fig, ax = plt.subplots(figsize=(11, 0.35 * result.cells + 1.4))
    for i, spans in enumerate(result.roles):
        by_role: dict[str, list[tuple[float, float]]] = {}
        for t0, t1, role in spans:
            by_role.setdefault(role, []).append((t0 / 3600, (t1 - t0) / 3600))
        for role, bars in by_role.items():
            ax.broken_barh(bars, (i - 0.4, 0.8), facecolors=ROLE_COLOURS.get(role, "#999999"), linewidth=0)
        if i < len(result.idle) and result.idle[i]:  # idle inside a role: washed out
            ax.broken_barh([(a / 3600, (b - a) / 3600) for a, b in result.idle[i]], (i - 0.4, 0.8),
                           facecolors="white", alpha=0.6, linewidth=0)
    ax.set_yticks(range(result.cells), [f"cell {i}" for i in range(result.cells)])
    ax.invert_yaxis()
    ax.set_xlim(0, hours or result.hours)
    ax.set_xlabel("hours")
    ax.set_title(f"{result.label}: cell roles ({result.cells} cells × {result.cell_size} nodes, "
                 f"{result.steps} steps, {result.hours:.1f} h)\n"
                 f"rollout critical {result.rollout_critical_share:.0%} of the time · trainer idle "
                 f"{result.trainer_idle_share:.0%} · rollout idle {result.rollout_idle_share:.0%} of "
                 f"their role time", fontsize=10)
    handles = [Patch(color=c, label=r) for r, c in ROLE_COLOURS.items() if r != "failed"]
    handles.append(Patch(facecolor="#F0C4A6", label="pale: idle in that role"))
    ax.legend(handles=handles,
              loc="upper center", bbox_to_anchor=(0.5, -0.25 if result.cells < 12 else -0.08), ncol=5, frameon=False)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def utilisation(results: list, path: str | Path, bin_h: float = 1.0) -> Path:
    """Left: busy share of the cells over time (binned). Right: time per bucket, per run."""
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.6), gridspec_kw={"width_ratios": [3, 2]})
    for r in results:
        xs, ys = _busy_series(r, bin_h)
        ax.step(xs, ys, where="post", label=f"{r.label} ({r.hours:.1f} h)")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("hours")
    ax.set_ylabel(f"cells busy (rollout or train), {bin_h:g} h bins")
    ax.legend(fontsize=8)
    left = [0.0] * len(results)
    labels = [r.label for r in results]
    for b in BUCKETS:
        vals = [r.bucket_total(b) / (r.makespan_s * r.cells) * r.hours for r in results]
        bx.barh(labels, vals, left=left, color=BUCKET_COLOURS[b], label=b)
        left = [l + v for l, v in zip(left, vals)]
    bx.invert_yaxis()
    bx.set_xlabel("hours (mean over cells)")
    bx.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _busy_series(r, bin_h: float) -> tuple[list[float], list[float]]:
    """Time-weighted share of busy cells in each bin, from the run's usage changes."""
    width = bin_h * 3600
    n = max(1, int(r.makespan_s // width) + 1)
    acc = [0.0] * n
    pts = list(r.usage) + [(r.makespan_s, 0, 0, 0, 0)]
    for (t0, ro, tr, _, _), (t1, *_rest) in zip(pts, pts[1:]):
        busy = (ro + tr) / r.cells
        while t0 < t1:
            b = int(t0 // width)
            edge = min(t1, (b + 1) * width)
            acc[min(b, n - 1)] += busy * (edge - t0)
            t0 = edge
    xs = [i * bin_h for i in range(n)]
    ys = [a / width for a in acc]
    if r.makespan_s % width:
        ys[-1] = acc[-1] / (r.makespan_s - (n - 1) * width)
    return xs, ys


def tornado(rows: list[dict], path: str | Path, title: str) -> Path:
    """Sensitivity: for each parameter, the ratio at the low and high end of its interval around
    the base value. rows: {param, low_label, high_label, ratios: {name: (low, high)}}, base: {name}."""
    names = list(rows[0]["ratios"]) if rows else []
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * max(1, len(names)), 0.45 * len(rows) + 1.6),
                             squeeze=False)
    for ax, name in zip(axes[0], names):
        base = rows[0]["base"][name]
        order = sorted(rows, key=lambda r: abs(r["ratios"][name][1] - r["ratios"][name][0]))
        for i, r in enumerate(order):
            lo, hi = r["ratios"][name]
            ax.barh(i, lo - base, left=base, color="#4C72B0", height=0.6)
            ax.barh(i, hi - base, left=base, color="#DD8452", height=0.6)
        ax.axvline(base, color="k", lw=0.8)
        ax.axvline(1.0, color="#999999", lw=0.8, ls=":")
        ax.set_yticks(range(len(order)), [f"{r['param']} [{r['low_label']} … {r['high_label']}]" for r in order],
                      fontsize=8)
        ax.set_xlabel(f"{name} (base {base:.2f}; dotted: equal time)")
    axes[0][0].legend(handles=[Patch(color="#4C72B0", label="low end"), Patch(color="#DD8452", label="high end")],
                      loc="lower right", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
