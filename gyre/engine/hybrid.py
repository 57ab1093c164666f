"""The embedded engine's forward for the hybrid families (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) and
its per-request cache: KV for the full-attention layers, and for each Gated DeltaNet layer a
recurrent state and a conv window (the last kernel-1 q/k/v inputs).

A recurrent state exists at one position only, so the cache also keeps *snapshots* of the linear
layers' states at the end of every prompt chunk it ran (and always at its current end). Copying the
cache for a prefix (the prefix cache's `lookup`) resumes from the deepest state at or before the
shared length: exactly there when the request extends the cached sequence, else from an earlier
snapshot, whose later tokens the request then recomputes; this is what SGLang's hybrid radix cache
(``MambaRadixCache``) does with the states it keeps at its tree nodes. States are never changed
in place, so snapshots and copies share tensors.

The maths is transformers' (gyre.model.gated_deltanet; tests compare log-probs per family).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from gyre.engine.qwen import CausalLM, KVCache
from gyre.model.gated_deltanet import (chunk_gated_delta_rule, gated_rms_norm, gdn_gates, recurrent_step,
                                       split_fused_qkvz)
from gyre.model.spec import ModelSpec, apply_rope

_State = tuple[list[torch.Tensor], list[torch.Tensor]]  # (conv windows, recurrent states) per linear layer


class HybridCache:
    """KV of the full-attention layers (a `KVCache` over those layers only) + linear-layer states."""

    def __init__(self, spec: ModelSpec, kv: KVCache | None = None, state: _State | None = None):
        self.spec = spec
        full = SimpleNamespace(layers=len(spec.full_layers), kv_heads=spec.kv_heads, head_dim=spec.head_dim,
                               moe_layers=spec.moe_layers, top_k=getattr(spec, "top_k", 0))
        self.kv = kv if kv is not None else KVCache(full)
        if state is None:
            n, K = len(spec.linear_layers), spec.conv_kernel
            state = ([torch.zeros(K - 1, spec.conv_dim) for _ in range(n)],
                     [torch.zeros(spec.lin_v_heads, spec.lin_k_dim, spec.lin_v_dim) for _ in range(n)])
        self.conv, self.ssm = state
        self.snapshots: dict[int, _State] = {}

    @property
    def length(self) -> int:
        return self.kv.length

    @length.setter
    def length(self, n: int) -> None:
        self.kv.length = n

    def snapshot(self) -> None:
        self.snapshots[self.length] = (list(self.conv), list(self.ssm))

    def copy(self, length: int) -> "HybridCache":
        """An independent cache at the deepest stored state at or before ``length`` (its
        ``length`` says where: the caller recomputes the rest)."""
        if length >= self.length:
            at, state = self.length, (list(self.conv), list(self.ssm))
        else:
            at = max((p for p in self.snapshots if p <= length), default=0)
            state = self.snapshots.get(at)
        out = HybridCache(self.spec, self.kv.copy(at), state)
        out.snapshots = {p: s for p, s in self.snapshots.items() if p <= at}
        return out

    def routed_experts(self, length: int | None = None) -> torch.Tensor | None:
        return self.kv.routed_experts(length)

    @property
    def routing(self):  # CausalLM._mlp records MoE routing here
        return self.kv.routing


class HybridCausalLM(CausalLM):
    """`CausalLM`'s interface (forward over a prompt chunk, batched decode) for hybrid families."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor]):
        super().__init__(spec, weights)
        self._kv_slot = {layer: i for i, layer in enumerate(spec.full_layers)}
        self._lin_slot = {layer: i for i, layer in enumerate(spec.linear_layers)}

    def new_cache(self) -> HybridCache:
        return HybridCache(self.spec)

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return (1.0 + self.w[name]) * (x * torch.rsqrt(var + self.spec.eps))  # zero-centred gain

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Partial RoPE on ``x`` ``[..., T or n, heads, d]`` laid out [T, heads, d]."""
        freqs = torch.outer(positions.float(), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        r = self.spec.rotary_dim
        return torch.cat([apply_rope(x[..., :r], emb.cos(), emb.sin()), x[..., r:]], dim=-1)

    def _attention(self, h, i, positions, caches: list[HybridCache], per_seq: bool) -> torch.Tensor:
        """Gated full attention of layer i: ``h`` [T, hidden] of one sequence (prefill), or one
        token of each of several sequences (``per_seq``)."""
        s, p = self.spec, f"model.layers.{i}.self_attn."
        T, d = h.shape[0], s.head_dim
        q, gate = self._linear(h, p + "q_proj").view(T, s.heads, 2 * d).chunk(2, dim=-1)
        q = self._rope(self._qk(q, p + "q_norm"), positions)
        k = self._rope(self._qk(self._linear(h, p + "k_proj").view(T, s.kv_heads, d), p + "k_norm"), positions)
        v = self._linear(h, p + "v_proj").view(T, s.kv_heads, d)
        groups, slot, scale = s.heads // s.kv_heads, self._kv_slot[i], 1 / math.sqrt(d)
        rows = [(j, j + 1, c) for j, c in enumerate(caches)] if per_seq else [(0, T, caches[0])]
        outs = []
        for a, b, cache in rows:
            keys, values = cache.kv.append(slot, k[a:b].transpose(0, 1), v[a:b].transpose(0, 1))
            if groups > 1:
                keys, values = keys.repeat_interleave(groups, 0), values.repeat_interleave(groups, 0)
            past = cache.length
            mask = None
            if b - a > 1:
                mask = torch.arange(past + b - a)[None, :] <= (past + torch.arange(b - a))[:, None]
            outs.append(F.scaled_dot_product_attention(q[a:b].transpose(0, 1), keys, values, attn_mask=mask,
                                                       scale=scale).transpose(0, 1))
        out = torch.cat(outs).reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1))
        return self._linear(out, p + "o_proj")

    def _project(self, h: torch.Tensor, p: str):
        """(pre-conv q/k/v [N, conv_dim], z [N, Hv, Dv], b, a [N, Hv]) of a linear layer."""
        s = self.spec
        if s.family.gdn_fused_proj:
            q, k, v, z, b, a = split_fused_qkvz(self._linear(h, p + "in_proj_qkvz"), self._linear(h, p + "in_proj_ba"),
                                                s.lin_k_heads, s.lin_k_dim, s.lin_v_heads, s.lin_v_dim)
            return torch.cat([q, k, v.flatten(-2)], dim=-1), z, b, a
        z = self._linear(h, p + "in_proj_z").view(-1, s.lin_v_heads, s.lin_v_dim)
        return self._linear(h, p + "in_proj_qkv"), z, self._linear(h, p + "in_proj_b"), self._linear(h, p + "in_proj_a")

    def _linear_attn(self, h, i, caches: list[HybridCache], per_seq: bool) -> torch.Tensor:
        s, p = self.spec, f"model.layers.{i}.linear_attn."
        slot, K, key = self._lin_slot[i], s.conv_kernel, s.lin_k_heads * s.lin_k_dim
        mixed, z, b, a = self._project(h, p)
        w = self.w[p + "conv1d.weight"][:, 0]                                   # [C, K]
        g, beta = gdn_gates(a, b, self.w[p + "A_log"], self.w[p + "dt_bias"])
        if per_seq:  # one token per sequence: conv window and state of each, batched
            window = torch.cat([torch.stack([c.conv[slot] for c in caches]), mixed[:, None]], dim=1)  # [n, K, C]
            x = F.silu(torch.einsum("nkc,ck->nc", window, w))
            q, k, v = torch.split(x, [key, key, s.lin_v_heads * s.lin_v_dim], dim=-1)
            out, states = recurrent_step(q.view(-1, s.lin_k_heads, s.lin_k_dim), k.view(-1, s.lin_k_heads, s.lin_k_dim),
                                         v.view(-1, s.lin_v_heads, s.lin_v_dim), g, beta,
                                         torch.stack([c.ssm[slot] for c in caches]))
            for j, c in enumerate(caches):
                c.conv[slot], c.ssm[slot] = window[j, 1:], states[j]
        else:
            cache = caches[0]
            ext = torch.cat([cache.conv[slot], mixed])                          # [K-1+T, C]
            x = F.silu(F.conv1d(ext.T[None], w[:, None], groups=w.shape[0])[0].T)  # [T, C]
            q, k, v = torch.split(x, [key, key, s.lin_v_heads * s.lin_v_dim], dim=-1)
            T = h.shape[0]
            out, state = chunk_gated_delta_rule(q.view(1, T, s.lin_k_heads, s.lin_k_dim),
                                                k.view(1, T, s.lin_k_heads, s.lin_k_dim),
                                                v.view(1, T, s.lin_v_heads, s.lin_v_dim), g[None], beta[None],
                                                cache.ssm[slot][None])
            out = out[0]
            cache.conv[slot], cache.ssm[slot] = ext[-(K - 1):].clone(), state[0]
        out = gated_rms_norm(out, z, self.w[p + "norm.weight"], s.eps)
        return self._linear(out.reshape(h.shape[0], -1), p + "out_proj")

    def _layers(self, x, positions, caches: list[HybridCache], per_seq: bool, starts: list[int]) -> torch.Tensor:
        for c in caches:  # MoE routing is recorded before the first full-attention layer appends
            c.kv._reserve(c.length + (1 if per_seq else x.shape[0]))
        for i in range(self.spec.layers):
            p = f"model.layers.{i}."
            h = self._norm(x, p + "input_layernorm.weight")
            if self.spec.is_linear(i):
                x = x + self._linear_attn(h, i, caches, per_seq)
            else:
                x = x + self._attention(h, i, positions, caches, per_seq)
            h = self._norm(x, p + "post_attention_layernorm.weight")
            record = ([(c, c.length, slice(j, j + 1)) for j, c in enumerate(caches)] if per_seq
                      else [(caches[0], starts[0], slice(0, x.shape[0]))])
            x = x + self._mlp(h, i, record)
        return x

    @torch.inference_mode()
    def forward(self, ids: list[int], cache: HybridCache) -> torch.Tensor:
        past = cache.length
        x = self.w["model.embed_tokens.weight"][torch.tensor(ids)]
        x = self._layers(x, torch.arange(past, past + len(ids)), [cache], False, [past])
        cache.length = past + len(ids)
        cache.snapshot()  # a later request sharing only this prompt's prefix resumes here
        return self._logits(x[-1])

    @torch.inference_mode()
    def decode(self, tokens: list[int], caches: list[HybridCache]) -> torch.Tensor:
        positions = torch.tensor([c.length for c in caches])
        x = self.w["model.embed_tokens.weight"][torch.tensor(tokens)]
        x = self._layers(x, positions, caches, True, positions.tolist())
        for cache in caches:
            cache.length += 1
        return self._logits(x)


def causal_lm(spec: ModelSpec, weights: dict[str, torch.Tensor]) -> CausalLM:
    """The engine's forward for a model directory's spec: hybrid families get `HybridCausalLM`."""
    return HybridCausalLM(spec, weights) if spec.hybrid else CausalLM(spec, weights)
