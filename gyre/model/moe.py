"""Top-k routing as the Qwen MoE families define it, shared by the engine's and trainer's forwards
(so both route a token to the same experts with the same weights).

Softmax over all experts in float32, the k largest, renormalised to sum 1 when
``norm_topk_prob`` (Qwen3-MoE configs set it), cast back to the input's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, norm_topk_prob: bool,
          replay: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[N, k]``, expert ids ``[N, k]``) for tokens ``x`` ``[N, H]``.

    `replay` (``[N, k]`` expert ids, e.g. what the engine routed when it sampled): routing replay
    (R3): those experts are used, weighted by this router's probabilities of them, so the
    gradient still reaches the router but no token changes experts. A row holding -1 (routing
    not recorded) routes freely."""
    probs = F.softmax(F.linear(x, gate_weight), dim=-1, dtype=torch.float32)
    if replay is None:
        weights, experts = torch.topk(probs, top_k, dim=-1)
    else:
        experts = replay.to(device=probs.device, dtype=torch.long)
        missing = (experts < 0).any(-1, keepdim=True)
        if missing.any():
            experts = torch.where(missing, torch.topk(probs, top_k, dim=-1).indices, experts)
        weights = probs.gather(-1, experts)
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
