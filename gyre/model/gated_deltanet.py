"""The gated delta rule of Gated DeltaNet layers (Qwen3-Next, Qwen3.5), shared by the embedded
engine's and trainer's forwards, as transformers' torch fallback computes it.

Per value head, with L2-normalised query/key, the recurrent state ``S`` (``[d_k, d_v]``) is

    S_t = exp(g_t) * S_{t-1} + k_t (beta_t * (v_t - exp(g_t) * S_{t-1}^T k_t))^T,  o_t = S_t^T q_t / sqrt(d_k)

`chunk_gated_delta_rule` runs a sequence in chunks (a UT transform per chunk, a scan over
chunks: the form flash-linear-attention's kernels use) from an initial state and returns the final
one, so a scan can stop at any position and a later call continue from there, which is what tree
training (a child from its parent's state) and the engine's prefix cache (a request from a cached
prefix's state) need. `recurrent_step` is the one-token form for decoding. `gated_rms_norm` is the
layer's output norm (RMSNorm, then times SiLU of the gate).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK = 64


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _heads(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Queries/keys repeated to the value heads (each key head serves consecutive value heads)."""
    rep = v.shape[-2] // k.shape[-2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)
    return q, k


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                           initial_state: Tensor | None = None, chunk: int = CHUNK
                           ) -> tuple[Tensor, Tensor]:
    """q, k ``[B, T, Hk, Dk]``, v ``[B, T, Hv, Dv]``, g (log decay, <= 0) and beta ``[B, T, Hv]``;
    initial_state ``[B, Hv, Dk, Dv]`` or None (zeros). Returns (out ``[B, T, Hv, Dv]`` in v's
    dtype, final state ``[B, Hv, Dk, Dv]`` float32). Math in float32."""
    dtype = v.dtype
    B, T, _, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    q, k = _heads(q, k, v)
    q, k, v, beta, g = (x.transpose(1, 2).float().contiguous() for x in (q, k, v, beta, g))
    q, k = l2norm(q), l2norm(k)
    q = q * Dk ** -0.5
    chunk = min(chunk, max(8, 1 << (T - 1).bit_length()))  # a short node is not padded to 64
    pad = (chunk - T % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    n = (T + pad) // chunk
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(B, Hv, n, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(B, Hv, n, chunk).cumsum(-1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    new_v = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(ut, k_beta * g.exp()[..., None], upper=False, unitriangular=True)
    state = (torch.zeros(B, Hv, Dk, Dv, device=q.device) if initial_state is None
             else initial_state.float())
    q = q * g.exp()[..., None]
    k = k * (g[..., -1:] - g).exp()[..., None]
    chunk_decay = g[..., -1].exp()[..., None, None]
    outs = []
    for i in range(n):
        v_new = new_v[:, :, i] - k_cum[:, :, i] @ state
        outs.append(q[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = torch.cat(outs, dim=2)[:, :, :T]
    return out.transpose(1, 2).to(dtype), state


def recurrent_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
                   ) -> tuple[Tensor, Tensor]:
    """One token per sequence: q, k ``[N, Hk, Dk]``, v ``[N, Hv, Dv]``, g/beta ``[N, Hv]``, state
    ``[N, Hv, Dk, Dv]`` -> (out ``[N, Hv, Dv]``, new state)."""
    q, k = _heads(q, k, v)
    q, k = l2norm(q.float()), l2norm(k.float())
    q = q * q.shape[-1] ** -0.5
    state = state.float() * g.float().exp()[..., None, None]
    delta = (v.float() - (state * k[..., None]).sum(-2)) * beta.float()[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(-2).to(v.dtype), state


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' RMSNormGated: normalise in float32, scale, times SiLU(gate) in float32."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return ((weight * x.to(dtype)) * F.silu(gate.float())).to(dtype)


def gdn_gates(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """(g, beta) of the layer: g = -exp(A_log) * softplus(a + dt_bias) (float32), beta = sigmoid(b)."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


def split_fused_qkvz(qkvz: Tensor, ba: Tensor, k_heads: int, k_dim: int, v_heads: int, v_dim: int
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Qwen3-Next's fused projections (grouped per key head) -> q, k ``[..., Hk*Dk]``, v, z
    ``[..., Hv, Dv]``, b, a ``[..., Hv]`` (transformers' fix_query_key_value_ordering)."""
    lead = qkvz.shape[:-1]
    per = v_heads // k_heads
    qkvz = qkvz.view(*lead, k_heads, 2 * k_dim + 2 * per * v_dim)
    ba = ba.view(*lead, k_heads, 2 * per)
    q, k, v, z = torch.split(qkvz, [k_dim, k_dim, per * v_dim, per * v_dim], dim=-1)
    b, a = torch.split(ba, [per, per], dim=-1)
    return (q.reshape(*lead, -1), k.reshape(*lead, -1), v.reshape(*lead, v_heads, v_dim),
            z.reshape(*lead, v_heads, v_dim), b.reshape(*lead, v_heads), a.reshape(*lead, v_heads))
