"""Target log-probs from hidden states, in chunks of targets: never the [S, vocab] logits.

Only the positions that predict a target (`pred_pos`) need an output projection at all. Their
hidden rows ([T, hidden], linear in length) are projected `chunk` at a time and reduced to one
log-prob each; under autograd every chunk is checkpointed, so forward and backward both hold
one chunk's [chunk, vocab] logits at a time. Gradients are those of the full computation.

`project` maps hidden rows to logits (the LM head; under Megatron tensor parallelism a vocab
shard) and `logp_of` reduces logits and targets to log-probs (default: log-softmax and gather;
Megatron: its vocab-parallel cross entropy). `temperature` is None (1), a float, or a per-target
tensor [T] (sampling parameters per token).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK = 4096  # targets per chunk: 4096 x 151,936 float32 logits = 2.5 GB at a real vocabulary


def log_softmax_gather(logits: Tensor, targets: Tensor) -> Tensor:
    """log p(target) of float32 logits [t, V]: the single-device reduction."""
    return torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1)


def _chunk_logprobs(rows: Tensor, targets: Tensor, temperature: Tensor | float,
                    project: Callable[[Tensor], Tensor], logp_of: Callable[[Tensor, Tensor], Tensor],
                    want_entropy: bool, per_token: bool = False) -> tuple[Tensor, Tensor]:
    """(log-probs [t], the chunk's entropy: its sum, detached, or with `per_token` each target's
    entropy [t] with gradient (the entropy bonus); a second output, not a side effect, so the
    checkpoint's recomputation in backward counts nothing twice)."""
    logits = project(rows).float() / temperature
    ent = logits.new_zeros(())
    if per_token:
        lsm = torch.log_softmax(logits, dim=-1)
        ent = -(lsm.exp() * lsm).sum(-1)
    elif want_entropy:
        with torch.no_grad():
            lsm = torch.log_softmax(logits, dim=-1)
            ent = -(lsm.exp() * lsm).sum()
    return logp_of(logits, targets), ent


def target_logprobs(rows: Tensor, project: Callable[[Tensor], Tensor], targets: Tensor, *,
                    temperature: Tensor | float | None = None, chunk: int = DEFAULT_CHUNK,
                    logp_of: Callable[[Tensor, Tensor], Tensor] = log_softmax_gather,
                    entropy: list | None = None, token_entropy: bool = False) -> Tensor:
    """float32 log p(target | prefix) [T] from the hidden rows [T, hidden] that predict them;
    ``entropy``: a list that receives each chunk's sum of token entropies (the logits of a full
    vocabulary: not for a tensor-parallel shard), or with `token_entropy` each chunk's per-target
    entropies [t] with gradient (``torch.cat(entropy)`` is then [T])."""
    if chunk < 1:
        raise ValueError(f"train.logprob_chunk must be >= 1, got {chunk}")
    T = rows.shape[0]
    if isinstance(temperature, Tensor):
        if temperature.shape != (T,):
            raise ValueError(f"per-target temperature has shape {tuple(temperature.shape)}, expected ({T},)")
        temperature = temperature.to(rows.device).float()
    elif temperature is None:
        temperature = 1.0
    targets = targets.to(rows.device)
    grad = torch.is_grad_enabled() and rows.requires_grad
    out = []
    # split, not slicing: its backward concatenates the chunks' gradients once, where each
    # slice's backward would write a zero-padded [T, hidden] gradient of its own
    temps = temperature[:, None].split(chunk) if isinstance(temperature, Tensor) else None
    for i, (r, t) in enumerate(zip(rows.split(chunk), targets.split(chunk))):
        args = (r, t, temps[i] if temps is not None else temperature, project, logp_of, entropy is not None,
                token_entropy and entropy is not None)
        logp, ent = checkpoint(_chunk_logprobs, *args, use_reentrant=False) if grad else _chunk_logprobs(*args)
        out.append(logp)
        if entropy is not None:
            entropy.append(ent if token_entropy else float(ent))
    return torch.cat(out) if out else rows.new_zeros(0, dtype=torch.float32)


def rows_at(hidden: Tensor, pred_pos: Tensor, *, seq_first: bool = False) -> Tensor:
    """The hidden rows [T, hidden] at flat positions b*S+i: `hidden` [B, S, H] (or [S, B, H]
    with `seq_first`, Megatron's layout), without copying the rest."""
    if seq_first:
        S, B, H = hidden.shape
        pred_pos = (pred_pos % S) * B + pred_pos // S
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, pred_pos.to(hidden.device))
