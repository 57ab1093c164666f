"""Top-k routing as the Qwen MoE families define it, shared by the engine's and trainer's forwards
(so both route a token to the same experts with the same weights).

Softmax over all experts in float32, the k largest, renormalised to sum 1 when
``norm_topk_prob`` (Qwen3-MoE configs set it), cast back to the input's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, norm_topk_prob: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[N, k]``, expert ids ``[N, k]``) for tokens ``x`` ``[N, H]``."""
    probs = F.softmax(F.linear(x, gate_weight), dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), experts


def tokens_per_expert(experts: torch.Tensor, n_experts: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """For each expert that got tokens: (expert, token rows, slot within the top-k)."""
    out = []
    for e in torch.unique(experts).tolist():
        rows, slot = torch.where(experts == e)
        out.append((int(e), rows, slot))
    return out
