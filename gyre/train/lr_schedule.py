"""The learning rate of each optimizer step: warmup, then constant, linear or cosine decay.

One formula, three readers: the embedded trainer (through torch's ``LambdaLR``), the Megatron-Core
trainer (through Megatron's own ``OptimizerParamScheduler``, whose formulas these are) and the
head, which logs the rate of every step without asking a trainer. Torch-free for the head.

Position: the update that makes optimizer step ``n`` (1-based: the first update of a run is
n = 1) trains at ``lr_at(n)``. Megatron counts from 0 and would give the first update
``init_lr`` = 0 under warmup; counting from 1 makes every warmup step train (step 1 at
lr / warmup, step `warmup` at lr) and the last step of the decay horizon at `min_lr`. Updates
inside a step (`train.minibatches_per_step`) share the step's rate. The position is the
trainer's optimizer step, so a trainer restored from a checkpoint continues the schedule where
the checkpoint's step puts it: nothing of the schedule is stored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LrSchedule:
    lr: float
    style: str = "constant"      # constant | linear | cosine (gyre.config.LrSchedule)
    warmup_steps: int = 0
    decay_steps: int = 1         # the step at which linear/cosine reach min_lr
    min_lr: float = 0.0

    @classmethod
    def from_config(cls, cfg) -> "LrSchedule":
        """From a TrainConfig; `lr_decay_steps` 0 (a run resolves it to run.steps, see
        gyre.config.trainer_config) is taken as one step past warmup."""
        return cls(cfg.lr, str(cfg.lr_schedule), cfg.lr_warmup_steps,
                   cfg.lr_decay_steps or cfg.lr_warmup_steps + 1, cfg.min_lr)

    @property
    def horizon(self) -> int:
        """Megatron's lr_decay_steps: above warmup (it asserts so)."""
        return max(self.decay_steps, self.warmup_steps + 1)

    def lr_at(self, step: int) -> float:
        """The learning rate of the update that makes optimizer step `step` (1-based)."""
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        if self.style == "constant":
            return self.lr
        if step > self.horizon:
            return self.min_lr
        ratio = (step - self.warmup_steps) / (self.horizon - self.warmup_steps)
        coeff = 1.0 - ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.lr - self.min_lr)

    def factor(self, done: int) -> float:
        """``LambdaLR``'s multiplier after `done` optimizer steps (its ``last_epoch``): the next
        update's rate over `lr`."""
        return self.lr_at(done + 1) / self.lr if self.lr > 0 else 0.0
