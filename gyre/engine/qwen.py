"""A small inference-only forward pass for the families of `gyre.model` (Qwen2, Llama, Qwen3,
Qwen3-MoE, Qwen2-MoE), with a KV cache we own.

Why not ``transformers`` ``model.generate``/``DynamicCache``: its per-call overhead is about
8 ms per decode step on these CPUs (ours: well under 1 ms for the tiny model), and its cache
API changes between releases; the engine needs to copy and crop caches for prefix reuse.
The maths is the transformers one (RMSNorm in float32, rotate-half RoPE, grouped-query
attention, q/k RMSNorm where the family has it, SiLU-gated MLP or top-k routed experts);
tests compare our log-probs with a transformers forward, per family.

What is supported is `gyre.model.families`; default RoPE (no scaling), no sliding window.
Weights are computed in float32 on CPU.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from gyre.model.moe import route, tokens_per_expert
from gyre.model.spec import ModelSpec, apply_rope, load_weights, read_spec

# Attention scores of one prompt chunk are computed for a few queries at a time, so that a chunk
# over a 256K-token context holds O(queries x context) scores, not O(chunk x context) (2 GB).
ATTN_SCORE_BYTES = 64 << 20


class KVCache:
    """Per-request keys/values, ``[kv_heads, capacity, head_dim]`` per layer, grown by doubling."""

    def __init__(self, spec: ModelSpec, capacity: int = 64):
        shape = (spec.kv_heads, capacity, spec.head_dim)
        self.k = [torch.empty(shape) for _ in range(spec.layers)]
        self.v = [torch.empty(shape) for _ in range(spec.layers)]
        self.length = 0
        # MoE: the experts each position was routed to, [capacity, moe layers, top_k] (SGLang keeps
        # them per KV slot too, so a cached prefix still answers return_routed_experts)
        self.routing = torch.empty((capacity, len(spec.moe_layers), spec.top_k), dtype=torch.int32) \
            if spec.moe_layers else None

    def _reserve(self, n: int) -> None:
        cap = self.k[0].shape[1]
        if n <= cap:
            return
        new = max(n, 2 * cap)
        for store in (self.k, self.v):
            for i, t in enumerate(store):
                grown = torch.empty((t.shape[0], new, t.shape[2]))
                grown[:, : self.length] = t[:, : self.length]
                store[i] = grown
        if self.routing is not None:
            grown = torch.empty((new, *self.routing.shape[1:]), dtype=torch.int32)
            grown[: self.length] = self.routing[: self.length]
            self.routing = grown

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v`` (``[kv, T, d]``) after the current length; return all keys/values so far."""
        start, end = self.length, self.length + k.shape[1]
        if layer == 0:
            self._reserve(end)
        self.k[layer][:, start:end] = k
        self.v[layer][:, start:end] = v
        return self.k[layer][:, :end], self.v[layer][:, :end]

    def copy(self, length: int) -> "KVCache":
        """An independent cache holding the first ``length`` positions."""
        out = KVCache.__new__(KVCache)
        cap = max(64, 1 << max(0, length - 1).bit_length())
        out.k = [torch.empty((t.shape[0], cap, t.shape[2])) for t in self.k]
        out.v = [torch.empty((t.shape[0], cap, t.shape[2])) for t in self.v]
        for src, dst in ((self.k, out.k), (self.v, out.v)):
            for s, d in zip(src, dst):
                d[:, :length] = s[:, :length]
        out.routing = None
        if self.routing is not None:
            out.routing = torch.empty((cap, *self.routing.shape[1:]), dtype=torch.int32)
            out.routing[:length] = self.routing[:length]
        out.length = length
        return out

    def routed_experts(self, length: int | None = None) -> torch.Tensor | None:
        """Experts of positions 0..length-1, ``[length, moe layers, top_k]`` int32 (None: dense)."""
        if self.routing is None:
            return None
        return self.routing[: self.length if length is None else length].clone()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class CausalLM:
    """Forward over a prompt chunk (:meth:`forward`) or a batch of decode steps (:meth:`decode`)."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor]):
        self.spec = spec
        self.w = weights
        self.inv_freq = spec.inv_freq()
        self._moe_slot: dict[int, int] = {}

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "CausalLM":
        spec = read_spec(model_dir)
        return cls(spec, load_weights(model_dir, spec))

    def new_cache(self) -> KVCache:
        return KVCache(self.spec)

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return self.w[name] * (x * torch.rsqrt(var + self.spec.eps))

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def _qk(self, x: torch.Tensor, norm: str) -> torch.Tensor:
        """Per-head RMSNorm of queries or keys ``[..., heads, d]`` (Qwen3), else unchanged."""
        return self._norm(x, norm + ".weight") if self.spec.qk_norm else x

    def _dense(self, h: torch.Tensor, p: str) -> torch.Tensor:
        return self._linear(F.silu(self._linear(h, p + "gate_proj")) * self._linear(h, p + "up_proj"), p + "down_proj")

    def _mlp(self, h: torch.Tensor, layer: int, record=()) -> torch.Tensor:
        """Layer's MLP on ``h`` ``[N, hidden]``: dense, or top-k routed experts (+ a gated shared one).
        `record`: (cache, first position, rows of h) whose routing the caches keep."""
        s, p = self.spec, f"model.layers.{layer}.mlp."
        if not s.is_moe(layer):
            return self._dense(h, p)
        weights, experts = route(h, self.w[p + "gate.weight"], s.top_k, s.norm_topk_prob)
        slot = self._moe_slot.get(layer)
        if slot is None:
            slot = self._moe_slot[layer] = sorted(s.moe_layers).index(layer)
        for cache, start, rows in record:
            n = rows.stop - rows.start  # capacity: reserved by layer 0's attention append
            cache.routing[start: start + n, slot] = experts[rows].to(torch.int32)
        out = torch.zeros_like(h)
        for e, rows, slot in tokens_per_expert(experts, s.experts):
            y = self._dense(h[rows], f"{p}experts.{e}.")
            out.index_add_(0, rows, y * weights[rows, slot, None])
        if s.shared_intermediate:
            out = out + torch.sigmoid(self._linear(h, p + "shared_expert_gate")) * self._dense(h, p + "shared_expert.")
        return out

    @torch.inference_mode()
    def forward(self, ids: list[int], cache: KVCache) -> torch.Tensor:
        """Run ``ids`` after what ``cache`` holds, extend the cache, return logits ``[vocab]``."""
        s, T, past = self.spec, len(ids), cache.length
        pos = torch.arange(past, past + T, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        x = self.w["model.embed_tokens.weight"][torch.tensor(ids)]
        groups = s.heads // s.kv_heads
        for i in range(s.layers):
            p = f"model.layers.{i}."
            h = self._norm(x, p + "input_layernorm.weight")
            q = self._qk(self._linear(h, p + "self_attn.q_proj").view(T, s.heads, s.head_dim), p + "self_attn.q_norm")
            k = self._qk(self._linear(h, p + "self_attn.k_proj").view(T, s.kv_heads, s.head_dim), p + "self_attn.k_norm")
            q, k = q.transpose(0, 1), k.transpose(0, 1)
            v = self._linear(h, p + "self_attn.v_proj").view(T, s.kv_heads, s.head_dim).transpose(0, 1)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            keys, values = cache.append(i, k, v)
            if groups > 1:
                keys = keys.repeat_interleave(groups, dim=0)
                values = values.repeat_interleave(groups, dim=0)
            attn = self._causal_attention(q, keys, values, past)
            x = x + self._linear(attn.transpose(0, 1).reshape(T, s.heads * s.head_dim), p + "self_attn.o_proj")
            h = self._norm(x, p + "post_attention_layernorm.weight")
            x = x + self._mlp(h, i, [(cache, past, slice(0, T))])
        cache.length = past + T
        return self._logits(x[-1])

    def _causal_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, past: int) -> torch.Tensor:
        """Attention of queries at positions past.. over keys 0..past+T-1 (query i sees keys up to
        past+i), in slices of queries whose scores fit ATTN_SCORE_BYTES (scores and softmax):
        memory O(slice x context). Every query sees the whole cached prefix, so only the chunk's own
        keys are masked. (CPU SDPA with a mask is slower and holds more at 64K+ keys.)"""
        heads, T = q.shape[0], q.shape[1]
        scale = 1 / math.sqrt(self.spec.head_dim)
        if T == 1:  # one token sees everything: no mask
            return F.scaled_dot_product_attention(q, keys, values, scale=scale)
        later = torch.ones(T, T, dtype=torch.bool).triu(1)  # key j of the chunk is after query i
        step = max(1, ATTN_SCORE_BYTES // (2 * 4 * heads * (past + T)))
        out = []
        keys_t = keys.transpose(1, 2)
        for a in range(0, T, step):
            b = min(T, a + step)
            scores = torch.matmul(q[:, a:b], keys_t).mul_(scale)
            scores[:, :, past:].masked_fill_(later[a:b], float("-inf"))
            out.append(torch.matmul(torch.softmax(scores, dim=-1), values))
        return out[0] if len(out) == 1 else torch.cat(out, dim=1)

    @torch.inference_mode()
    def decode(self, tokens: list[int], caches: list[KVCache]) -> torch.Tensor:
        """One decode step for several sequences at once (token i extends ``caches[i]``).
        Projections and MLP run batched; attention runs per sequence (lengths differ).
        Returns logits ``[len(tokens), vocab]``."""
        s, n = self.spec, len(tokens)
        pos = torch.tensor([c.length for c in caches], dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [n, 1, d], broadcast over heads
        cos, sin = emb.cos(), emb.sin()
        x = self.w["model.embed_tokens.weight"][torch.tensor(tokens)]
        groups = s.heads // s.kv_heads
        scale = 1 / math.sqrt(s.head_dim)
        for i in range(s.layers):
            p = f"model.layers.{i}."
            h = self._norm(x, p + "input_layernorm.weight")
            q = self._qk(self._linear(h, p + "self_attn.q_proj").view(n, s.heads, s.head_dim), p + "self_attn.q_norm")
            k = self._qk(self._linear(h, p + "self_attn.k_proj").view(n, s.kv_heads, s.head_dim), p + "self_attn.k_norm")
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            v = self._linear(h, p + "self_attn.v_proj").view(n, s.kv_heads, s.head_dim)
            outs = []
            for j, cache in enumerate(caches):
                keys, values = cache.append(i, k[j].unsqueeze(1), v[j].unsqueeze(1))
                if groups > 1:
                    keys = keys.repeat_interleave(groups, dim=0)
                    values = values.repeat_interleave(groups, dim=0)
                outs.append(F.scaled_dot_product_attention(q[j].unsqueeze(1), keys, values, scale=scale))
            attn = torch.stack(outs).reshape(n, s.heads * s.head_dim)
            x = x + self._linear(attn, p + "self_attn.o_proj")
            h = self._norm(x, p + "post_attention_layernorm.weight")
            x = x + self._mlp(h, i, [(c, c.length, slice(j, j + 1)) for j, c in enumerate(caches)])
        for cache in caches:
            cache.length += 1
        return self._logits(x)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        head = self.w["model.embed_tokens.weight"] if self.spec.tied else self.w["lm_head.weight"]
        return F.linear(self._norm(x, "model.norm.weight"), head)
