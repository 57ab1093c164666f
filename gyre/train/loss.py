"""Policy-gradient loss on a micro-batch, with the off-policy corrections of `train.off_policy`.

Three policies meet in a step: pi_behaviour (the engine's recorded log-probs, `mb.old_logprobs`,
possibly several optimizer steps old and computed with other numerics), pi_prox (the trainer at
the start of the step, `prox_logprobs`) and pi_theta (the trainer's differentiable forward). Until
the step's first update pi_prox IS pi_theta, so no extra forward runs: the loss takes pi_theta's
values without gradient. With `train.minibatches_per_step` > 1 (PPO-style updates within a step,
`Trainer.train_step`) the later minibatches get pi_prox from one no-grad forward at the step's
start, and only then does the clip against pi_prox act. With A_t the advantage and w_t the step's per-token weight:

    none       l_t = -min(r_t A_t, clip(r_t) A_t),      r_t = pi_theta / pi_behaviour
    tis        l_t = -c_t min(r_t A_t, clip(r_t) A_t),  r_t = pi_theta / pi_prox,
               c_t = min(pi_prox / pi_behaviour, is_cap)                (truncated IS, slime/verl)
    decoupled  l_t = -c_t min(r_t A_t, clip(r_t) A_t),  r_t = pi_theta / pi_prox,
               c_t = pi_prox / pi_behaviour                              (AReaL's decoupled PPO)

clip(r) = clamp(r, 1 - clip_low, 1 + clip_high). c_t is a constant (no gradient); with `is_mask`
a token whose pi_prox / pi_behaviour leaves [is_mask_low, is_mask_high] gets c_t = 0. The clip is
a trust region around the policy being updated, so it is taken against pi_prox: against
pi_behaviour a stale or numerically different sample would sit outside the region before any
update and its gradient would be cut for a reason that is not the update's size. The importance
weight corrects what pi_prox is not: the distribution the tokens were actually sampled from.

loss = sum_t w_t * staleness_weight(s_t) * (l_t + kl_coef * kl_t - entropy_coef * H_t); because
`weights` are precomputed for the whole step, summing over micro-batches and data-parallel ranks
gives the step's loss exactly. kl_t is Schulman's estimator (`train.kl_estimator`) of
KL(pi_theta || pi_ref) at the target, with pi_ref a frozen copy of the initial weights
(gyre.train.reference) and d_t = log pi_theta - log pi_ref:

    k1 = d_t        k2 = d_t^2 / 2        k3 = exp(-d_t) - 1 + d_t

(k3, verl's `low_var_kl`, is unbiased for KL(pi_theta || pi_ref) under samples of pi_theta and never
negative). H_t is the token entropy of pi_theta at the target's position and sampling temperature,
with gradient (gyre.train.logprobs, chunked). Both terms are off (0) by default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from gyre.config import OffPolicyMode
from gyre.batch import MicroBatch
from gyre.train.step_stats import LOG_RATIO_BINS, LOG_RATIO_HI, LOG_RATIO_LO

OFF_POLICY = ("none", "tis", "decoupled")


@dataclass(frozen=True)
class OffPolicy:
    """Which correction, and its constants (see the module doc)."""
    mode: str = "none"
    is_cap: float = 2.0
    mask: bool = False
    mask_low: float = 0.5
    mask_high: float = 2.0

    def __post_init__(self) -> None:
        if self.mode not in OFF_POLICY:
            raise ValueError(f"train.off_policy {self.mode!r}: choose one of {', '.join(OFF_POLICY)} (or auto)")
        if self.is_cap <= 0:
            raise ValueError(f"train.is_cap must be > 0, got {self.is_cap}")
        if self.mask and not 0 <= self.mask_low < self.mask_high:
            raise ValueError(f"train.is_mask_low ({self.mask_low}) must be >= 0 and below "
                             f"train.is_mask_high ({self.mask_high})")

    @property
    def needs_prox(self) -> bool:
        return self.mode != "none"

    @classmethod
    def from_config(cls, cfg) -> "OffPolicy":
        """From a TrainConfig whose `auto` a run resolved (gyre.config.trainer_config); a TrainConfig
        used on its own has no schedule: nothing lags, so `auto` is tis."""
        mode = OffPolicyMode.TIS if cfg.off_policy == OffPolicyMode.AUTO else cfg.off_policy
        return cls(mode, cfg.is_cap, cfg.is_mask, cfg.is_mask_low, cfg.is_mask_high)


KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass(frozen=True)
class Regularizers:
    """The KL-to-reference and entropy terms of the module doc; both 0 (off) by default."""
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"train.kl_estimator {self.kl_estimator!r}: choose one of {', '.join(KL_ESTIMATORS)}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError(f"train.kl_coef ({self.kl_coef}) and train.entropy_coef ({self.entropy_coef}) must be >= 0")

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0

    @classmethod
    def from_config(cls, cfg) -> "Regularizers":
        return cls(cfg.kl_coef, str(cfg.kl_estimator), cfg.entropy_coef)


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from the targets' log-probs (module doc)."""
    d = logp - ref_logp
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.expm1(-d) + d
    raise ValueError(f"train.kl_estimator {estimator!r}: choose one of {', '.join(KL_ESTIMATORS)}")


def sampling_temperature(rows: Tensor, temperature: Tensor) -> Tensor:
    """Target logits [T, V] divided by each target's sampling temperature [T]: the one place the
    trainer reproduces the engine's transformation (SGLang reports log_softmax(logits / T),
    unfiltered by top-k / top-p / min-p; docs/openai.md)."""
    return rows / temperature.to(rows.device, rows.dtype)[:, None]


def token_logprobs(logits: Tensor, mb: MicroBatch) -> Tensor:
    """log p(target | prefix) at each target's sampling temperature, float32, for each target [T]."""
    return _target_log_softmax(logits, mb)[0]


def _target_log_softmax(logits: Tensor, mb: MicroBatch) -> tuple[Tensor, Tensor]:
    """(log p(target) [T], the full log-softmax rows at the target positions [T, V])."""
    flat = logits.reshape(-1, logits.shape[-1])
    rows = flat.index_select(0, mb.pred_pos.to(flat.device)).float()  # only the rows we need
    logp = torch.log_softmax(sampling_temperature(rows, mb.temperature), dim=-1)
    return logp.gather(1, mb.target_ids.to(flat.device)[:, None]).squeeze(1), logp


def entropy_sum(rows: Tensor) -> float:
    """Sum over target positions of the policy's token entropy -sum_v p log p, from the
    log-softmax rows the loss already holds (no second pass over the logits); the collapse
    warning watches its per-target mean (`entropy`)."""
    with torch.no_grad():
        return float(-(rows.exp() * rows).sum())


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


def importance_weights(prox: Tensor, behaviour: Tensor, off: OffPolicy) -> tuple[Tensor, Tensor, Tensor]:
    """(c_t, truncated, masked) of the module doc; c_t = 1 everywhere for `none`."""
    if not off.needs_prox:
        ones = torch.ones_like(behaviour)
        return ones, torch.zeros_like(ones, dtype=torch.bool), torch.zeros_like(ones, dtype=torch.bool)
    raw = torch.exp(prox - behaviour)
    truncated = raw > off.is_cap if off.mode == "tis" else torch.zeros_like(raw, dtype=torch.bool)
    c = raw.clamp(max=off.is_cap) if off.mode == "tis" else raw
    masked = ((raw < off.mask_low) | (raw > off.mask_high)) if off.mask else torch.zeros_like(truncated)
    return torch.where(masked, torch.zeros_like(c), c), truncated, masked


def policy_loss(logits: Tensor, mb: MicroBatch, clip_low: float = 0.2, clip_high: float = 0.28,
                **kw) -> tuple[Tensor, dict]:
    """`policy_loss_from_logprobs` of full [B, S, V] logits (tests and small callers)."""
    logp, rows = _target_log_softmax(logits, mb)
    return policy_loss_from_logprobs(logp, mb, clip_low, clip_high, entropy=entropy_sum(rows), **kw)


def policy_loss_from_logprobs(logp: Tensor, mb: MicroBatch, clip_low: float = 0.2, clip_high: float = 0.28,
                              *, clip: bool = True, staleness_weights: Sequence[float] | None = None,
                              off_policy: OffPolicy | None = None, prox_logprobs: Tensor | None = None,
                              entropy: float | None = None, reg: Regularizers | None = None,
                              ref_logprobs: Tensor | None = None,
                              token_entropy: Tensor | None = None) -> tuple[Tensor, dict]:
    """(loss, stats) for one micro-batch from its targets' current log-probs [T] (float32, with
    gradient); `loss` is a sum, ready for gradient accumulation.

    `prox_logprobs`: pi_prox (no gradient) when the weights moved since the step's start; None
    means they did not, so pi_prox is pi_theta's own value (detached). `entropy`: the sum over
    targets of the policy's token entropy where the log-prob computation had it (None: not known).
    `reg`: the KL and entropy terms; `ref_logprobs` [T] (no gradient) the reference's log-probs,
    needed when reg.kl_coef > 0; `token_entropy` [T] the per-target entropy with gradient, needed
    when reg.entropy_coef > 0.
    """
    reg = reg or Regularizers()
    off = off_policy or OffPolicy()
    dev = logp.device
    behaviour = mb.old_logprobs.to(dev).float()
    if prox_logprobs is None:  # the weights of the step's start: pi_prox = pi_theta
        prox = logp.detach()
    else:
        prox = prox_logprobs.to(dev).float().detach()
    adv = mb.advantages.to(dev).float()
    w = mb.weights.to(dev).float() * staleness_factor(mb.staleness.to(dev), staleness_weights)
    c, truncated, masked = importance_weights(prox, behaviour, off)
    anchor = prox if off.needs_prox else behaviour  # the policy the ratio (and the clip) is taken against
    ratio = torch.exp(logp - anchor)
    unclipped = ratio * adv
    if clip:
        clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
        per_token = -torch.minimum(unclipped, clipped)
        clipped_mask = clipped < unclipped  # the clip is what the loss actually used
    else:
        per_token = -unclipped
        clipped_mask = torch.zeros_like(ratio, dtype=torch.bool)
    loss = (w * c * per_token).sum()
    kl = None
    if reg.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("train.kl_coef > 0 needs the reference's log-probs (ref_logprobs)")
        kl = kl_estimate(logp, ref_logprobs.to(dev).float().detach(), reg.kl_estimator)
        loss = loss + reg.kl_coef * (w * kl).sum()
    if reg.entropy_coef > 0:
        if token_entropy is None:
            raise ValueError("train.entropy_coef > 0 needs the targets' token entropy with gradient (token_entropy)")
        loss = loss - reg.entropy_coef * (w * token_entropy.float()).sum()
        if entropy is None:
            entropy = float(token_entropy.detach().sum())
    with torch.no_grad():
        n = max(mb.num_targets, 1)
        d = logp.detach() - anchor
        stats = {
            "loss": float(loss),
            "targets": mb.num_targets,
            "tokens": mb.num_tokens,
            "ratio_mean": float(ratio.sum() / n),
            "ratio_max": float(ratio.max()) if mb.num_targets else 0.0,
            "clip_frac": float(clipped_mask.float().sum() / n),
            "logp_mean": float(logp.sum() / n),
            "entropy": None if entropy is None else entropy / n,  # merged as a mean weighted by targets
            "kl_old": float((torch.exp(-d) - 1 + d).sum() / n),  # k3 estimator of KL(anchor || cur)
            **({} if kl is None else {"kl_ref": float(kl.detach().sum() / n)}),  # the penalty's estimator
            "weight_sum": float(w.sum()),
            "is_weight_mean": float(c.sum() / n),
            "truncated_n": int(truncated.sum()),
            "masked_n": int(masked.sum()),
            # how far pi_theta has moved from pi_prox (0 before the step's first update)
            "prox_drift_max": float((prox - logp.detach()).abs().max()) if mb.num_targets else 0.0,
            **mismatch_stats(prox, behaviour, mb.staleness.to(dev)),
        }
    return loss, stats


def mismatch_stats(trainer: Tensor, behaviour: Tensor, staleness: Tensor) -> dict:
    """Per policy lag: |logp_trainer - logp_behaviour| (sum, max), the k3 estimate of
    KL(behaviour || trainer) (sum; tokens are behaviour samples) and the token count; plus the
    log-ratio histogram of the whole micro-batch. Sums, so they merge (gyre.train.step_stats)."""
    out: dict = {}
    d = trainer - behaviour  # log(pi_trainer / pi_behaviour)
    k3 = torch.expm1(d) - d
    for lag in torch.unique(staleness).tolist():
        sel = staleness == lag
        out[f"mm_lag{lag}_n"] = int(sel.sum())
        out[f"mm_lag{lag}_abs_sum"] = float(d[sel].abs().sum())
        out[f"mm_lag{lag}_abs_max"] = float(d[sel].abs().max())
        out[f"mm_lag{lag}_k3_sum"] = float(k3[sel].sum())
    width = (LOG_RATIO_HI - LOG_RATIO_LO) / LOG_RATIO_BINS
    idx = torch.where(d < LOG_RATIO_LO, 0, torch.where(
        d >= LOG_RATIO_HI, LOG_RATIO_BINS + 1,
        1 + ((d - LOG_RATIO_LO) / width).floor().clamp(0, LOG_RATIO_BINS - 1).long()))
    out["log_ratio_hist"] = torch.bincount(idx.long().cpu(), minlength=LOG_RATIO_BINS + 2).tolist()
    return out
