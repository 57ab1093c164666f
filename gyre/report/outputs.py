"""What a session of a run writes as it goes: the metrics sink (metrics.jsonl, TensorBoard, W&B)
and the console (a line per step, how the run ended), both fed every event with its row.

Out of the head so that the head is its loop: it opens these at start, tells them each event
(with the step row `RunStats` made) and closes them at the end; the whole run's report.json is
gyre/report/history.py's.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from gyre.config import GyreConfig
from gyre.events import Event, RunStats
from gyre.report.metrics import MetricsSink
from gyre.report.progress import Progress


class Outputs:
    def __init__(self) -> None:
        self.metrics: MetricsSink | None = None
        self.progress: Progress | None = None

    def open(self, cfg: GyreConfig, run_dir: Path, first_step: int, cells: int, bar: bool) -> None:
        """The sink and the console of a session that starts at `first_step` (0, or where it resumed)."""
        self.metrics = MetricsSink(run_dir, cfg.run.loggers, name=cfg.run.name, config=asdict(cfg),
                                   wandb_mode=cfg.run.wandb_mode.value, first_step=first_step)
        self.progress = Progress(cfg.run.steps, cfg.run.groups_per_step * cfg.harness.group_size,
                                 first_step=first_step, bar=bar)
        print(f"gyre: run {run_dir} started: {cfg.run.steps - first_step} steps to go ({cells} cells, "
              f"scheme {cfg.sched.scheme}{cfg.sched.staleness}); metrics: {', '.join(self.metrics.active)}",
              flush=True)

    def on_event(self, event: Event, stats: RunStats, row: dict | None) -> None:
        for out in (self.metrics, self.progress):
            if out is not None:
                out.on_event(event, stats, row)

    def close(self, steps_done: int, wall_s: float, *, cancelled: bool, why: str | None, run_dir: Path) -> None:
        """Close the sink; the console's last line (ended, cancelled with how to resume, or why it stopped)."""
        self.metrics.close()
        self.progress.end(steps_done, wall_s, cancelled=cancelled, why=why,
                          resume_hint=f"gyre run --resume run.dir={run_dir} (on Slurm: gyre submit --resume)")
        for e in self.metrics.errors:
            print(f"gyre: note: {e}", flush=True)

    @property
    def errors(self) -> list[str]:
        return list(self.metrics.errors) if self.metrics else []

    def describe(self) -> dict | None:
        return self.metrics.describe() if self.metrics else None
