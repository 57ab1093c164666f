"""The live console of a run: one line per step as it ends, a bar of the executions ending on a
terminal, the health warnings, and how the run ended.

Fed the same events as the metrics sink (gyre/events.py) with the step row `RunStats` made, so
the line shows the figures steps.jsonl holds. Lines go to `out` (the head's stdout: the console
under `gyre run`, the job output under Slurm), flushed at once; the bar only when `bar` is set
(`gyre run` asks for it when its own stdout is a terminal) and never into a file.
"""

from __future__ import annotations

import sys
from typing import TextIO

from gyre.events import Event, ExecutionEvaluated, RunStats, StepEnded


def limits_line(counts: dict[str, int]) -> str:
    """"2 stopped by limits: max_workspace_files x2" ("" when none was)."""
    if not counts:
        return ""
    return (f"{sum(counts.values())} stopped by limits: "
            + ", ".join(f"{k} x{n}" for k, n in sorted(counts.items())))


def duration(seconds: float) -> str:
    """1h02m, 4m10s, 37s: the width a step line can afford."""
    s = int(round(max(seconds, 0.0)))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _rate(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / 1000:.1f}k" if x >= 1000 else f"{x:.0f}"


class Progress:
    def __init__(self, total_steps: int, executions_per_step: int, *, first_step: int = 0,
                 out: TextIO | None = None, bar: bool = False, name: str = "gyre") -> None:
        self.total, self.first, self.name = total_steps, first_step, name
        self.out = out or sys.stdout
        self.said: set[str] = set()           # warning kinds told in full once; later steps name them
        self._bar = None
        if bar:
            from tqdm import tqdm

            self._bar = tqdm(total=executions_per_step, file=self.out, leave=False, dynamic_ncols=True,
                             desc=f"step {first_step + 1}/{total_steps} executions", unit="exec")

    def _print(self, line: str) -> None:
        if self._bar is not None:
            self._bar.clear()
        print(line, file=self.out, flush=True)
        if self._bar is not None:
            self._bar.refresh()

    def on_event(self, ev: Event, stats: RunStats, row: dict | None = None) -> None:
        if isinstance(ev, ExecutionEvaluated) and self._bar is not None:
            if self._bar.n >= self._bar.total:  # executions of the next steps end early under async schemes
                self._bar.total = self._bar.n + 1
            self._bar.update(1)
        elif isinstance(ev, StepEnded) and row is not None:
            self._print(self.step_line(row))
            for kind, why in (row.get("warnings") or {}).items():
                if kind not in self.said:
                    self.said.add(kind)
                    self._print(f"{self.name}: warning: step {row['step'] + 1}: {why}")
            if self._bar is not None:
                self._bar.reset()
                self._bar.set_description(f"step {min(row['step'] + 2, self.total)}/{self.total} executions")

    def step_line(self, row: dict) -> str:
        """step 3/14  reward 0.41±0.20 (n 8)  exec 24 done 8 running  1.2k tok/s  lag 0.50/1  2m31s  ETA 4m10s

        (with `2 harness failures` after the reward when executions ended so since the last step:
        their harnesses failed or crashed by themselves, and their scores are not in the reward)."""
        step = row["step"] + 1
        rew = "-" if row.get("reward_mean") is None else (
            f"{row['reward_mean']:.3g}±{row.get('reward_std') or 0.0:.2g} (n {row.get('reward_n', 0)})")
        done_here = step - self.first
        eta = row["t_end"] / done_here * (self.total - step) if done_here > 0 else None
        parts = [f"{self.name}: step {step}/{self.total}", f"reward {rew}"]
        if row.get("harness_failures"):  # told apart from the rewards: never one of their samples
            n = row["harness_failures"]
            parts.append(f"{n} harness failure{'s' if n != 1 else ''}")
        parts += [f"exec {row.get('executions_done', 0)} done {row.get('executions_running', 0)} running",
                  f"{_rate(row.get('tokens_per_s'))} tok/s",
                  f"lag {row.get('staleness_mean', 0):.2f}/{row.get('staleness_max', 0)}",
                  duration(row["t_end"]), "ETA " + ("-" if eta is None else duration(eta))]
        if row.get("stopped_by_limits"):
            parts.append(limits_line(row["stopped_by_limits"]))
        kinds = list(row.get("warnings") or {})
        if kinds:
            parts.append("warn: " + ",".join(kinds))
        return "  ".join(parts)

    def end(self, steps_done: int, wall_s: float, *, cancelled: bool = False, why: str | None = None,
            resume_hint: str = "") -> None:
        """The run's last line: ended, cancelled (with how to resume) or stopped (and why)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if why:
            line = f"{self.name}: run stopped at step {steps_done}/{self.total} after {duration(wall_s)}: {why}"
        elif cancelled:
            line = f"{self.name}: run cancelled at step {steps_done}/{self.total} after {duration(wall_s)}"
        else:
            line = f"{self.name}: run ended: {steps_done}/{self.total} steps in {duration(wall_s)}"
        if (cancelled or why) and resume_hint:
            line += f"; resume with: {resume_hint}"
        print(line, file=self.out, flush=True)
