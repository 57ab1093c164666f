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
