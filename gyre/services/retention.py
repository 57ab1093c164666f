"""What a run keeps on disk of its weights: engine exports and trainer checkpoints, bounded.

Every step writes the engines' export ``weights/v<N>`` and the trainer checkpoint
``checkpoints/v<N>`` (plus ``v<N>u<k>`` inside a step of several updates). Kept after step N commits:

- **engine exports**: the rollout version the engines serve and the one before it (a cell still
  loading it when the round turned), and the committed version (what a resume pushes first);
  anything newer than the committed version is being written and is never touched;
- **checkpoints**: the committed one (what a resume or a restarted trainer loads), every
  ``run.checkpoint_every``-th step among the ``run.keep_checkpoints`` newest of those (0 = all), and
  the ``run.keep_best`` best by ``run.best_metric`` (a key of the step rows, e.g. a validation
  reward, read from each step's row when present); checkpoints inside a step (``v<N>u<k>``) go once
  step N+1 is committed.

``run.disk_budget_gb`` bounds the exports and checkpoints together: when the next step would cross
it, the run is told once per crossing (a notice and a warning line), before it happens.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from gyre.position import Position

WARN_AT = 1.0   # warn when used + one more step's bytes would exceed this share of the budget


def dir_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (0 when it does not exist)."""
    if not path.exists():
        return 0
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def positions(root: Path) -> dict[Position, Path]:
    """The position directories under ``root`` (temporary and other names are not positions)."""
    if not root.is_dir():
        return {}
    return {at: d for d in root.iterdir() if d.is_dir() and (at := Position.of_name(d.name)) is not None}


@dataclass
class Retention:
    weights_root: Path
    ckpt_root: Path
    checkpoint_every: int = 1
    keep_checkpoints: int = 0           # 0 = every checkpoint_every-th step is kept
    keep_best: int = 0
    best_metric: str = ""
    best_mode: str = "max"
    disk_budget_bytes: float = math.inf
    metric: dict[int, float] = field(default_factory=dict)   # step version -> its best_metric value
    warned: bool = False

    @classmethod
    def from_config(cls, cfg, weights_root: Path, ckpt_root: Path) -> "Retention":
        r = cfg.run
        budget = r.disk_budget_gb * 1e9 if r.disk_budget_gb > 0 else math.inf
        return cls(Path(weights_root), Path(ckpt_root), r.checkpoint_every, r.keep_checkpoints, r.keep_best,
                   r.best_metric, str(r.best_metric_mode), budget)

    def record(self, row: dict) -> None:
        """A committed step's row: its value of ``best_metric`` (when it has one) is remembered."""
        value = row.get(self.best_metric) if self.best_metric else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            self.metric[int(row["version"])] = float(value)

    def kept_checkpoints(self, committed: int) -> set[int]:
        """Whole-step checkpoints kept once ``committed`` is (versions; the committed one included)."""
        every = [v for v in range(1, committed + 1) if v % self.checkpoint_every == 0]
        newest = every[-self.keep_checkpoints:] if self.keep_checkpoints else every
        sign = -1.0 if self.best_mode == "max" else 1.0
        best = sorted(self.metric, key=lambda v: (sign * self.metric[v], -v))[:self.keep_best]
        return {committed, *newest, *(v for v in best if v <= committed)}

    def kept_exports(self, committed: int, served: int) -> set[int]:
        return {committed, served, max(served - 1, 0)}

    def after_commit(self, committed: int, served: int) -> list[Path]:
        """Delete what step ``committed`` (the engines serving ``served``) no longer needs; returns
        what went. Nothing past ``committed`` is touched: it is being written."""
        gone = []
        keep_w, keep_c = self.kept_exports(committed, served), self.kept_checkpoints(committed)
        if self.weights_root.resolve() == self.ckpt_root.resolve():  # one directory for both: keep either's
            keep_w = keep_c = keep_w | keep_c
        for root, keep in ((self.weights_root, keep_w), (self.ckpt_root, keep_c)):
            for at, d in positions(root).items():
                if at > Position(committed):
                    continue
                if (at.boundary and at.step in keep) or at == Position(committed):
                    continue
                shutil.rmtree(d, ignore_errors=True)
                gone.append(d)
        return gone

    def used_bytes(self) -> int:
        return dir_bytes(self.weights_root) + dir_bytes(self.ckpt_root)

    def step_bytes(self, committed: int) -> int:
        """What one more step writes: the committed step's export and checkpoint."""
        at = str(Position(committed))
        return dir_bytes(self.weights_root / at) + dir_bytes(self.ckpt_root / at)

    def budget_warning(self, committed: int) -> str | None:
        """A warning, once per crossing, when the next step would take exports and checkpoints
        past ``run.disk_budget_gb``; None while within it."""
        if not math.isfinite(self.disk_budget_bytes):
            return None
        used, nxt = self.used_bytes(), self.step_bytes(committed)
        over = used + nxt > WARN_AT * self.disk_budget_bytes
        if not over:
            self.warned = False
            return None
        if self.warned:
            return None
        self.warned = True
        return (f"weights and checkpoints use {used / 1e9:.3g} GB and the next step writes ~{nxt / 1e9:.3g} GB: "
                f"past run.disk_budget_gb = {self.disk_budget_bytes / 1e9:.3g}; raise run.checkpoint_every, lower "
                f"run.keep_checkpoints / run.keep_best, or raise the budget")

    def after_step(self, row: dict, committed: int, served: int) -> str | None:
        """Once a step is committed (state.json points at it): note its row, drop what no engine,
        resume or retention rule needs, and return the disk budget's warning if any (blocking I/O:
        the head runs it in a thread)."""
        self.record(row)
        self.after_commit(committed, served)
        return self.budget_warning(committed)
