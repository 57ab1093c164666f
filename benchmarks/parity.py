"""Parity figures shared by the model-family benchmarks (bench_moe.py, bench_hybrid.py): Gyre's
trainer module and engine against transformers' reference on the same weights."""

from __future__ import annotations

import torch

from gyre.model.spec import split_fused_experts


def logits_and_grads(want: torch.Tensor, got: torch.Tensor, hf, ours) -> dict:
    """Largest logit difference, then both models backpropagate one random target and the largest
    gradient difference per parameter, relative to that parameter's largest reference gradient
    (transformers' fused expert weights split into Gyre's per-expert names)."""
    out = {"logits_max_abs_diff": float((got - want).detach().abs().max())}
    target = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    (want * target).sum().backward()
    (got * target).sum().backward()
    ref = split_fused_experts({n: p.grad for n, p in hf.named_parameters()})
    out["grad_max_abs_diff"] = max(float((p.grad - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-12))
                                   for n, p in ours.named_parameters())
    return out


def engine_decode_diff(engine, cache, seq: list[int], ref_logprobs: torch.Tensor, prefill: int) -> float:
    """Largest log-prob difference of the engine against the reference: ``prefill`` tokens in one
    forward, then one decode step per token of the rest of ``seq`` (``cache`` ends holding them)."""
    diffs = [float((torch.log_softmax(engine.forward(seq[:prefill], cache), -1) - ref_logprobs[prefill - 1]).abs().max())]
    for j in range(prefill, len(seq)):
        lp = torch.log_softmax(engine.decode([seq[j]], [cache])[0], -1)
        diffs.append(float((lp - ref_logprobs[j]).abs().max()))
    return max(diffs)
