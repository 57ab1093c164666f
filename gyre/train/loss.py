"""Policy-gradient loss on a micro-batch, against the engine's recorded behaviour log-probs.

loss = sum_t weights_t * staleness_weight(s_t) * l_t, with
    l_t = -min(r_t * A_t, clip(r_t, 1 - clip_low, 1 + clip_high) * A_t)   (clip=True, PPO-style)
    l_t = -r_t * A_t                                                      (clip=False)
and r_t = exp(logp_t - old_t). Because `weights` are precomputed for the whole step, summing the
loss (and gradients) over micro-batches and data-parallel ranks gives the step's loss exactly.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from gyre.batch import MicroBatch


def token_logprobs(logits: Tensor, mb: MicroBatch) -> Tensor:
    """log p(target | prefix) at temperature mb.temperature, float32, for each target [T]."""
    flat = logits.reshape(-1, logits.shape[-1])
    rows = flat.index_select(0, mb.pred_pos.to(flat.device)).float()  # only the rows we need
    logp = torch.log_softmax(rows / mb.temperature, dim=-1)
    return logp.gather(1, mb.target_ids.to(flat.device)[:, None]).squeeze(1)


def staleness_factor(staleness: Tensor, staleness_weights: Sequence[float] | None) -> Tensor:
    """Per-token weight by policy lag: staleness_weights[lag]; lags past the list get 0 (masked).

    None or an empty list weighs every admitted token 1.
    """
    if not staleness_weights:
        return torch.ones(staleness.shape, dtype=torch.float32, device=staleness.device)
    try:  # a command-line override gives strings
        values = [float(w) for w in staleness_weights]
    except ValueError:
        raise ValueError(f"train.staleness_weights must be numbers, got {staleness_weights!r}") from None
    table = torch.tensor(values + [0.0], dtype=torch.float32, device=staleness.device)
    return table[staleness.clamp(min=0, max=len(staleness_weights))]


def policy_loss(logits: Tensor, mb: MicroBatch, clip_low: float = 0.2, clip_high: float = 0.28,
                *, clip: bool = True,
                staleness_weights: Sequence[float] | None = None) -> tuple[Tensor, dict]:
    """(loss, stats) for one micro-batch; `loss` is a sum, ready for gradient accumulation."""
    dev = logits.device
    logp = token_logprobs(logits, mb)
    old = mb.old_logprobs.to(dev).float()
    adv = mb.advantages.to(dev).float()
    w = mb.weights.to(dev).float() * staleness_factor(mb.staleness.to(dev), staleness_weights)
    ratio = torch.exp(logp - old)
    unclipped = ratio * adv
    if clip:
        clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
        per_token = -torch.minimum(unclipped, clipped)
        clipped_mask = clipped < unclipped  # the clip is what the loss actually used
    else:
        per_token = -unclipped
        clipped_mask = torch.zeros_like(ratio, dtype=torch.bool)
    loss = (w * per_token).sum()
    with torch.no_grad():
        n = max(mb.num_targets, 1)
        d = logp.detach() - old
        stats = {
            "loss": float(loss),
            "targets": mb.num_targets,
            "tokens": mb.num_tokens,
            "ratio_mean": float(ratio.sum() / n),
            "ratio_max": float(ratio.max()) if mb.num_targets else 0.0,
            "clip_frac": float(clipped_mask.float().sum() / n),
            "logp_mean": float(logp.sum() / n),
            "kl_old": float((torch.exp(-d) - 1 + d).sum() / n),  # k3 estimator of KL(old || cur)
            "weight_sum": float(w.sum()),
        }
    return loss, stats
