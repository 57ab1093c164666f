"""Tables and plots of a live run, from what the head recorded (report.json)."""

from __future__ import annotations

from pathlib import Path

ROLE_COLORS = {"rollout": "#4C72B0", "train": "#DD8452", "to_train": "#C44E52", "to_rollout": "#8172B3",
               "failed": "#333333"}


def print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    t = Table(title=f"cells ({report['label']}, {report['wall_s']:.1f} s)")
    for col in ("cell", "host", "rollout s", "train s", "switching s", "idle s", "switches", "utilisation"):
        t.add_column(col, justify="right")
    for c in report["cells"]:
        t.add_row(str(c["cell"]), c["hostname"], f"{c['rollout_s']:.1f}", f"{c['train_s']:.1f}",
                  f"{c['switching_s']:.1f}", f"{c['idle_s']:.1f}", str(c["switches"]), f"{c['utilisation']:.0%}")
    con.print(t)
    s = Table(title="steps")
    for col in ("step", "groups", "micro-batches", "reward", "staleness mean/max", "loss/target", "grad norm",
                "replaced", "mismatch k3 (lag 0)", "cells", "end s"):
        s.add_column(col, justify="right")
    for r in report["steps"]:
        rew = "-" if r["reward_mean"] is None else f"{r['reward_mean']:.3f}"
        gn = "-" if r["grad_norm"] is None else f"{r['grad_norm']:.3f}"
        s.add_row(str(r["step"]), str(r["groups"]), str(r["micro_batches"]), rew,
                  f"{r['staleness_mean']:.2f}/{r['staleness_max']}", readable_loss(r), gn,
                  f"{r.get('replaced_share', 0.0):.0%}", _sci(r.get("mismatch_k3_lag0")),
                  ",".join(map(str, r["participants"])), f"{r['t_end']:.1f}")
    con.print(s)
    for w in report.get("warnings", []):
        con.print(f"[yellow]warning[/yellow] {w}")
    for e in report.get("errors", []):
        con.print(f"[red]error[/red] {e}")


def _sci(x) -> str:
    return "-" if x is None else f"{x:.1e}"


def readable_loss(row: dict) -> str:
    """The step's loss per target token in 3 significant figures: a GRPO loss is ~0 by
    construction (advantages sum to ~0 in each group), so a fixed 4-decimal format reads 0.0000
    at every step; the value that moves is small, not absent."""
    v = row.get("loss_per_target")
    if v is None:
        v = row.get("loss")
    return "-" if v is None else f"{v:+.2e}"


def gantt(report: dict, path: str | Path, t0: float | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    intervals = report["intervals"]
    start = t0 if t0 is not None else min((a for ivs in intervals.values() for _, a, _ in ivs), default=0.0)
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(intervals) + 1.2))
    for cell, ivs in intervals.items():
        for role, a, b in ivs:
            ax.barh(int(cell), b - a, left=a - start, color=ROLE_COLORS.get(role, "#999"), height=0.8)
    for r in report["steps"]:
        ax.axvline(r["t_end"], color="k", lw=0.6, ls=":")
    ax.set_yticks(sorted(int(c) for c in intervals))
    ax.set_yticklabels([f"cell {c}" for c in sorted(int(c) for c in intervals)])
    ax.set_xlabel("seconds since start (dotted: step ends)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ROLE_COLORS.values()]
    ax.legend(handles, list(ROLE_COLORS), ncol=5, loc="upper center", bbox_to_anchor=(0.5, 1.18), fontsize=8)
    ax.set_title(f"cell roles, {report['label']}", pad=28)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def reward_curve(report: dict, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in report["steps"] if r["reward_mean"] is not None]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in steps], [r["reward_mean"] for r in steps], marker="o")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward of the step's executions")
    ax.set_title(f"reward, {report['label']}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
