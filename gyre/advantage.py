"""Advantage estimators: one scalar per execution, from its reward relative to its group."""

from __future__ import annotations

import torch
from torch import Tensor

ESTIMATORS = ("grpo", "rloo", "reward")


def advantages(rewards: Tensor, groups: Tensor, estimator: str = "grpo", eps: float = 1e-6) -> Tensor:
    """Per-execution advantages.

    grpo:   (r - group mean) / (group std + eps), std with Bessel's correction as in GRPO; a group of
            one (or all-equal rewards) gets 0, since it carries no relative signal.
    rloo:   r - mean of the *other* executions of the group (leave-one-out baseline); 0 alone.
    reward: r itself.
    """
    r = rewards.double()
    if estimator == "reward":
        return r.float()
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {ESTIMATORS}")
    _, g = torch.unique(groups, return_inverse=True)
    k = g.max().item() + 1 if g.numel() else 0
    n = torch.zeros(k, dtype=torch.float64).index_add_(0, g, torch.ones_like(r))
    s = torch.zeros(k, dtype=torch.float64).index_add_(0, g, r)
    ng, sg = n[g], s[g]
    if estimator == "rloo":
        out = torch.where(ng > 1, r - (sg - r) / (ng - 1).clamp(min=1), torch.zeros_like(r))
        return out.float()
    mean = sg / ng
    sq = torch.zeros(k, dtype=torch.float64).index_add_(0, g, (r - mean) ** 2)[g]
    std = torch.sqrt(sq / (ng - 1).clamp(min=1))
    out = torch.where(ng > 1, (r - mean) / (std + eps), torch.zeros_like(r))
    return out.float()
