"""Advantage estimators: one scalar per execution, from its reward relative to its group.

Computed in numpy (float64, float32 out): the head fixes advantages when it materializes a step
and has no other use for torch, whose import alone costs a job ~1 s of CPU per process. The
tensor form (`advantages`) wraps the same computation for the trainer side and tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from torch import Tensor

ESTIMATORS = ("grpo", "rloo", "reward")


def group_advantages(rewards: np.ndarray, groups: np.ndarray, estimator: str = "grpo",
                     eps: float = 1e-6) -> np.ndarray:
    """Per-execution advantages (float32), ``groups`` any integer labels.

    grpo:   (r - group mean) / (group std + eps), std with Bessel's correction as in GRPO; a group of
            one (or all-equal rewards) gets 0, since it carries no relative signal.
    rloo:   r - mean of the *other* executions of the group (leave-one-out baseline); 0 alone.
    reward: r itself.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if estimator == "reward":
        return r.astype(np.float32)
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {ESTIMATORS}")
    _, g = np.unique(np.asarray(groups), return_inverse=True)
    g = g.reshape(-1)
    k = int(g.max()) + 1 if g.size else 0
    n = np.bincount(g, minlength=k).astype(np.float64)
    s = np.bincount(g, weights=r, minlength=k)
    ng, sg = n[g], s[g]
    alone = ng <= 1
    if estimator == "rloo":
        out = np.where(alone, 0.0, r - (sg - r) / np.maximum(ng - 1, 1))
        return out.astype(np.float32)
    mean = sg / ng if g.size else sg
    sq = np.bincount(g, weights=(r - mean) ** 2, minlength=k)[g]
    std = np.sqrt(sq / np.maximum(ng - 1, 1))
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(alone, 0.0, (r - mean) / (std + eps))
    return out.astype(np.float32)


def advantages(rewards: "Tensor", groups: "Tensor", estimator: str = "grpo", eps: float = 1e-6) -> "Tensor":
    """`group_advantages` on tensors: a float32 tensor on the rewards' device."""
    import torch  # the trainer side and tests only

    out = group_advantages(rewards.detach().double().cpu().numpy(), groups.detach().cpu().numpy(), estimator, eps)
    return torch.from_numpy(out).to(rewards.device)
