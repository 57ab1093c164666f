"""The split of a step into PPO-style updates (`train.minibatches_per_step`), one function for the
offline trainer (`gyre.train.base.Trainer.train_step`) and the live head (the coordinator core's
open step, the training service's loss scales). Pure Python: the scheduler and the trainers both
import it, neither imports the other."""

from __future__ import annotations

from typing import Iterable


def minibatch_parts(items: Iterable, minibatches: int) -> list[list]:
    """A step's micro-batches in ``minibatches`` consecutive, near-equal parts (never more parts
    than micro-batches): the one split of PPO-style updates (train.minibatches_per_step), offline
    (`gyre.train.base.Trainer.train_step`) and live (the open step's updates)."""
    items = list(items)
    n = max(1, min(int(minibatches), len(items)))
    return [items[i * len(items) // n:(i + 1) * len(items) // n] for i in range(n)]


def minibatch_scales(part_weights: list[float]) -> list[float]:
    """Per part (from its summed loss weights): the factor that makes its weights sum to the
    whole step's, so every update is a mean over its own tokens (1 with a single part)."""
    total = sum(part_weights)
    if len(part_weights) == 1:
        return [1.0]
    return [total / max(w, 1e-30) for w in part_weights]
