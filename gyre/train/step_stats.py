"""Micro-batch statistics merged into a step's, and the off-policy mismatch summary of a step.

Torch-free on purpose: the head merges the stats its cells reply with, and the head has no torch.

A micro-batch's stats (gyre.train.loss.policy_loss) are flat; the key says how to merge them:

    loss, targets, tokens, *_n, *_sum   summed
    *_hist                              summed element-wise (fixed bins, see LOG_RATIO_EDGES)
    *_max / *_min                       max / min
    fwd_bwd_s                           max (the parts ran in parallel; across micro-batches: sum)
    anything else                       mean weighted by targets

so the same rule merges a micro-batch's row slices over a cell's ranks and a step's micro-batches,
and the result does not depend on how a step was split.
"""

from __future__ import annotations

import math
from typing import Iterable

# log(pi_trainer / pi_behaviour) histogram: bins 0.01 wide in log space (1% in the ratio) over
# about [-2, 2] (ratios 0.14..7.4), one centred on 0 so agreeing numerics read ratio 1.00, plus
# an under- and an overflow bin. Fixed bins make quantiles mergeable across micro-batches and
# cells (exact quantiles would need every token's ratio at the head); 403 counts per micro-batch.
LOG_RATIO_BINS = 401
LOG_RATIO_LO, LOG_RATIO_HI = -0.01 * LOG_RATIO_BINS / 2, 0.01 * LOG_RATIO_BINS / 2
QUANTILES = (0.01, 0.5, 0.99)
_SUMMED = ("loss", "targets", "tokens")


def _kind(key: str) -> str:
    if key in _SUMMED or key.endswith(("_n", "_sum")):
        return "sum"
    if key.endswith("_hist"):
        return "hist"
    if key.endswith("_max"):
        return "max"
    if key.endswith("_min"):
        return "min"
    return "mean"


def merge(parts: Iterable[dict | None], *, parallel: bool = True) -> dict:
    """One dict from several micro-batch (or row-slice) stats. `parallel`: the parts ran at once
    (ranks of a cell: time is the longest) rather than one after another (time adds up)."""
    parts = [p for p in parts if p]
    if not parts:
        return {"loss": 0.0, "targets": 0, "tokens": 0, "fwd_bwd_s": 0.0}
    n = sum(p.get("targets", 0) for p in parts)
    keys: dict[str, None] = {}
    for p in parts:
        keys.update(dict.fromkeys(p))
    out: dict = {}
    for k in keys:
        have = [p for p in parts if k in p and p[k] is not None]
        if not have:
            out[k] = None
            continue
        kind = "max" if k == "fwd_bwd_s" and parallel else "sum" if k == "fwd_bwd_s" else _kind(k)
        vals = [p[k] for p in have]
        if kind == "sum":
            out[k] = sum(vals)
        elif kind == "hist":
            out[k] = [sum(col) for col in zip(*vals)]
        elif kind == "max":
            out[k] = max(vals)
        elif kind == "min":
            out[k] = min(vals)
        else:
            w = [p.get("targets", 0) for p in have]
            out[k] = sum(v * x for v, x in zip(vals, w)) / max(sum(w), 1) if sum(w) else vals[0]
    out.setdefault("targets", n)
    return out


def hist_quantile(hist: list, q: float) -> float | None:
    """The q-quantile of the ratio exp(log ratio) from the histogram: the centre of the bin it
    falls in (the outer bins report their edge)."""
    total = sum(hist)
    if not total:
        return None
    width = (LOG_RATIO_HI - LOG_RATIO_LO) / LOG_RATIO_BINS
    target, seen = q * total, 0.0
    for i, c in enumerate(hist):
        if c and seen + c >= target:
            if i == 0:
                return math.exp(LOG_RATIO_LO)
            if i == LOG_RATIO_BINS + 1:
                return math.exp(LOG_RATIO_HI)
            return math.exp(LOG_RATIO_LO + (i - 0.5) * width)
        seen += c
    return math.exp(LOG_RATIO_HI)


def lags_in(stats: dict) -> list[int]:
    return sorted(int(k[len("mm_lag"):-len("_n")]) for k in stats if k.startswith("mm_lag") and k.endswith("_n"))


def summarize(stats: dict) -> dict:
    """The step's mismatch figures from merged stats: per policy lag L (optimizer steps) the mean
    and max of |logp_trainer - logp_behaviour| and the k3 KL estimate of KL(behaviour || trainer),
    the truncated and masked token fractions, and quantiles of pi_trainer / pi_behaviour."""
    out: dict = {}
    for lag in lags_in(stats):
        n = stats[f"mm_lag{lag}_n"]
        if not n:
            continue
        out[f"mismatch_abs_mean_lag{lag}"] = stats[f"mm_lag{lag}_abs_sum"] / n
        out[f"mismatch_abs_max_lag{lag}"] = stats[f"mm_lag{lag}_abs_max"]
        out[f"mismatch_k3_lag{lag}"] = stats[f"mm_lag{lag}_k3_sum"] / n
        out[f"mismatch_tokens_lag{lag}"] = n
    t = stats.get("targets") or 0
    if t and "truncated_n" in stats:
        out["truncated_frac"] = stats["truncated_n"] / t
        out["masked_frac"] = stats.get("masked_n", 0) / t
    hist = stats.get("log_ratio_hist")
    if hist:
        for q in QUANTILES:
            out[f"ratio_q{int(round(q * 100)):02d}"] = hist_quantile(hist, q)
    return out


def lag0_warning(summary: dict, threshold: float) -> str | None:
    """A warning when trainer and engine disagree at the same weights (lag 0) by more than the
    threshold: numerics that far apart mean wrong weights, a wrong template or a wrong dtype."""
    k3 = summary.get("mismatch_k3_lag0")
    if threshold <= 0 or k3 is None or k3 <= threshold:
        return None
    return (f"train/inference mismatch at lag 0: k3 KL {k3:.3g} > train.mismatch_warn_k3 = {threshold:g} "
            f"(mean |logp_trainer - logp_engine| {summary.get('mismatch_abs_mean_lag0', float('nan')):.3g}); "
            f"engine and trainer disagree at the same weights: check the weights each loaded, the chat "
            f"template and the dtype")
