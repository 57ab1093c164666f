"""Tables and plots of a live run, from what the head recorded (report.json)."""

from __future__ import annotations

from pathlib import Path

ROLE_COLORS = {"rollout": "#4C72B0", "train": "#DD8452", "to_train": "#C44E52", "to_rollout": "#8172B3",
               "failed": "#333333"}


LEGEND = {"rollout": "rollout (serving calls)", "train": "train (micro-batches)", "to_train": "switching to train",
          "to_rollout": "switching to rollout", "failed": "failed"}
IDLE_ALPHA = 0.6  # white drawn over a role's colour where the cell had no work in that role


def _washed(color: str) -> tuple[float, float, float]:
    """The colour idle time shows as: `color` under white at IDLE_ALPHA."""
    rgb = [int(color[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    return tuple(IDLE_ALPHA + (1 - IDLE_ALPHA) * c for c in rgb)


def _num(x: float | None) -> str:
    """Three significant digits, any magnitude (a per-token loss of 3e-5 stays readable)."""
    return "-" if x is None else f"{x:.3g}"


def print_report(report: dict, console=None) -> None:
    """The live run's tables, narrow enough for an 80-column terminal (headers wrap, never cut).
    Per cell, busy rollout + busy train + switching + idle + failed add up to the wall time."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    con = console or Console()
    t = Table(title=f"cells ({report['label']}, {report['wall_s']:.1f} s)", box=box.SIMPLE_HEAD,
              caption="seconds; rollout, train: busy in that role; idle: in a role with no work;\n"
                      "rollout + train + switch + idle + failed = wall")
    t.add_column("cell", justify="right", no_wrap=True)
    t.add_column("host", overflow="fold", max_width=24)
    for col in ("rollout", "train", "switch", "idle", "failed", "switches", "util"):
        t.add_column(col, justify="right", no_wrap=True)
    for c in report["cells"]:
        t.add_row(str(c["cell"]), c["hostname"] or "-", f"{c['busy_rollout_s']:.1f}", f"{c['busy_train_s']:.1f}",
                  f"{c['switching_s']:.1f}", f"{c['idle_s']:.1f}", f"{c.get('failed_s', 0.0):.1f}",
                  str(c["switches"]), f"{c['utilisation']:.0%}")
    con.print(t)
    s = Table(title="steps", box=box.SIMPLE_HEAD, pad_edge=False,
              caption="grp/mb: groups/micro-batches; lag in optimizer steps; loss per target\n"
                      "token; repl.: share of zero-variance groups replaced; end: seconds since\n"
                      "start (train/inference mismatch per step: steps.jsonl)")
    # every figure keeps its width (a cut number reads as another number); only the cells list wraps
    for col, width in (("step", 4), ("grp/\nmb", 5), ("reward", 6), ("lag\nmean/max", 8), ("loss", 9),
                       ("grad\nnorm", 8), ("repl.", 5), ("cells", 5), ("end", 5)):
        s.add_column(col, justify="right", no_wrap=col != "cells", min_width=width, overflow="fold")
    for r in report["steps"]:
        rew = "-" if r["reward_mean"] is None else f"{r['reward_mean']:.3f}"
        s.add_row(str(r["step"] + 1), f"{r['groups']}/{r['micro_batches']}", rew,
                  f"{r['staleness_mean']:.2f}/{r['staleness_max']}", readable_loss(r), _num(r["grad_norm"]),
                  f"{r.get('replaced_share', 0.0):.0%}",
                  ",".join(map(str, r["participants"])), f"{r['t_end']:.0f}")
    con.print(s)
    con.print(token_truth_table(report["steps"]))
    for w in report.get("warnings", []):
        con.print(f"[yellow]warning[/yellow] {w}")
    for e in report.get("errors", []):
        con.print(f"[red]error[/red] {e}")


def token_truth_table(steps: list[dict]):
    """Per step: is what trained what was sampled (the audit), and how far apart trainer and engine
    are (lag-0 k3) and how much the clip acted."""
    from rich import box
    from rich.table import Table

    t = Table(title="token truth", box=box.SIMPLE_HEAD, pad_edge=False,
              caption="audit: trained tokens whose id or behaviour log-prob\n"
                      "differs from what the engine returned (goal 0) / tokens\n"
                      "audited; k3 lag 0: train/inference mismatch at the same\n"
                      "weights; clip: share of tokens the clip cut")
    for col, width in (("step", 4), ("audit", 9), ("k3 lag 0", 9), ("clip", 5), ("first offending call", 20)):
        t.add_column(col, justify="right" if col != "first offending call" else "left", min_width=width,
                     overflow="fold")
    for r in steps:
        n = r.get("audit_mismatched_tokens")
        audit = "-" if n is None else f"{n}/{r.get('audit_tokens', 0)}"
        clip = r.get("clip_frac")
        t.add_row(str(r["step"] + 1), audit, _num(r.get("mismatch_k3_lag0")), "-" if clip is None else f"{clip:.1%}",
                  r.get("audit_first_offender") or "-")
    return t


def readable_loss(row: dict) -> str:
    """The step's loss per target token in 3 significant figures: a GRPO loss is ~0 by
    construction (advantages sum to ~0 in each group), so a fixed 4-decimal format reads 0.0000
    at every step; the value that moves is small, not absent."""
    v = row.get("loss_per_target")
    return _num(row.get("loss") if v is None else v)


def gantt(report: dict, path: str | Path, t0: float | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    intervals = report["intervals"]
    start = t0 if t0 is not None else min((a for ivs in intervals.values() for _, a, _ in ivs), default=0.0)
    fig, ax = plt.subplots(figsize=(12, max(0.6 * len(intervals) + 1.2, 2.8)))  # room for the legend's 8 rows
    idle = report.get("idle") or {}
    for cell, ivs in intervals.items():
        for role, a, b in ivs:
            ax.barh(int(cell), b - a, left=a - start, color=ROLE_COLORS.get(role, "#999"), height=0.8)
        for a, b in idle.get(cell, idle.get(str(cell), [])):  # idle inside a role: washed out
            ax.barh(int(cell), b - a, left=a - start, color="white", alpha=IDLE_ALPHA, height=0.8, linewidth=0)
    for r in report["steps"]:
        ax.axvline(r["t_end"], color="k", lw=0.6, ls=":")
    ax.set_yticks(sorted(int(c) for c in intervals))
    ax.set_yticklabels([f"cell {c}" for c in sorted(int(c) for c in intervals)])
    ax.set_xlabel("seconds since start (dotted: step ends; pale: idle inside the role)")
    # every colour drawn is named: the roles, the washed-out idle of each working role, the step ends
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ROLE_COLORS.values()]
    handles += [plt.Rectangle((0, 0), 1, 1, color=_washed(ROLE_COLORS[r])) for r in ("rollout", "train")]
    handles.append(plt.Line2D([0], [0], color="k", lw=0.6, ls=":"))
    ax.legend(handles, [LEGEND[r] for r in ROLE_COLORS] + ["rollout cell idle", "train cell idle", "step end"],
              loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    ax.set_title(f"cell roles, {report['label']}")
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
    ax.plot([r["step"] + 1 for r in steps], [r["reward_mean"] for r in steps], marker="o")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward of the step's executions")
    ax.set_title(f"reward, {report['label']}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
