"""The embedded trainer's model for the hybrid families (Qwen3-Next, Qwen3.5, Qwen3.5-MoE):
Gated DeltaNet layers (gyre.train.gated_deltanet) beside output-gated full-attention layers,
transformers' maths op for op ((1 + weight) RMSNorms, partial RoPE, q/k norms, sigmoid output gate,
dense MLP or routed experts with a gated shared expert), checkpoint names.

The micro-batch's structure is one `kv_end` (a `TreeMask`, a dense tree mask, or None for causal
rows): full-attention layers attend through it exactly as `Qwen2LM`'s do; linear layers scan the
tree it describes with their state forked at branch points (`TreeScan`). `hidden` returns the final
normalised hidden states; `forward` applies the LM head to them (the same hidden -> logits seam as
`Qwen2LM`). Construction, weight checks and MoE auxiliary loss are `Qwen2LM`'s.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint
from torch import Tensor, nn

from gyre.model.spec import ModelSpec, apply_rope, rms_norm
from gyre.train.gated_deltanet import GatedDeltaNet, TreeScan
from gyre.train.qwen2 import MLP, Decoder, Embedding, Linear, Qwen2LM, SparseMoE
from gyre.train.tree_attention import TreeMask, attention, kv_end_from_mask


class OffsetRMSNorm(nn.Module):
    """Qwen3-Next / Qwen3.5 RMSNorm: the gain is (1 + weight), weight stored around 0."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x.float(), 1.0 + self.weight.float(), self.eps).to(x.dtype)


class GatedAttention(nn.Module):
    """Full attention whose q_proj also yields a per-channel output gate (sigmoid); RoPE on the
    first `rotary_dim` dimensions of each head."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, d = spec.hidden, spec.head_dim
        self.heads, self.kv_heads, self.head_dim, self.rot = spec.heads, spec.kv_heads, d, spec.rotary_dim
        self.q_proj = Linear(h, spec.heads * d * 2, bias=spec.qkv_bias)
        self.k_proj = Linear(h, spec.kv_heads * d, bias=spec.qkv_bias)
        self.v_proj = Linear(h, spec.kv_heads * d, bias=spec.qkv_bias)
        self.o_proj = Linear(spec.heads * d, h, bias=False)
        self.q_norm = OffsetRMSNorm(d, spec.eps)
        self.k_norm = OffsetRMSNorm(d, spec.eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask) -> Tensor:
        B, S, _ = x.shape
        q, gate = self.q_proj(x).view(B, S, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, S, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = partial_rope(q, cos, sin, self.rot), partial_rope(k, cos, sin, self.rot)
        out = attention(q, k, v, mask, self.head_dim ** -0.5).transpose(1, 2).reshape(B, S, -1)
        return self.o_proj(out * torch.sigmoid(gate.reshape(B, S, -1)))


def partial_rope(x: Tensor, cos: Tensor, sin: Tensor, rot: int) -> Tensor:
    if rot == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)


class HybridLayer(nn.Module):
    def __init__(self, spec: ModelSpec, index: int) -> None:
        super().__init__()
        self.linear = spec.is_linear(index)
        if self.linear:
            self.linear_attn = GatedDeltaNet(spec)
        else:
            self.self_attn = GatedAttention(spec)
        self.mlp = SparseMoE(spec) if spec.is_moe(index) else MLP(spec)
        self.input_layernorm = OffsetRMSNorm(spec.hidden, spec.eps)
        self.post_attention_layernorm = OffsetRMSNorm(spec.hidden, spec.eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask, tree: TreeScan) -> Tensor:
        h = self.input_layernorm(x)
        x = x + (self.linear_attn(h, tree) if self.linear else self.self_attn(h, cos, sin, mask))
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridDecoder(Decoder):
    def __init__(self, spec: ModelSpec) -> None:
        nn.Module.__init__(self)
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden)
        self.layers = nn.ModuleList(HybridLayer(spec, i) for i in range(spec.layers))
        self.norm = OffsetRMSNorm(spec.hidden, spec.eps)
        self.register_buffer("inv_freq", spec.inv_freq(), persistent=False)


class HybridLM(Qwen2LM):
    """Decoder plus LM head; ``forward`` returns logits ``[B, S, vocab]``."""

    def __init__(self, config: dict) -> None:
        nn.Module.__init__(self)
        self.spec = ModelSpec(config)
        if not self.spec.hybrid:
            raise ValueError(f"{self.spec.model_type} is not a hybrid family; use Qwen2LM")
        self.config = dict(config)
        self.model = HybridDecoder(self.spec)
        self.lm_head = Linear(self.spec.hidden, self.spec.vocab_size, bias=False)
        if self.spec.tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def hidden(self, input_ids: Tensor, position_ids: Tensor | None = None, attention_mask=None,
               routed_experts: Tensor | None = None, *, recompute: bool = False) -> Tensor:
        """Final normalised hidden states ``[B, S, hidden]``. `attention_mask`: a `TreeMask`, a
        dense bool tree mask (True = masked) or None (causal rows). `recompute`: activation
        checkpointing per layer (not with replayed routing: the replay is module state here, which
        a backward-time recomputation would no longer see)."""
        recompute = recompute and torch.is_grad_enabled()
        if recompute and routed_experts is not None:
            raise ValueError("train.recompute with train.routing_replay is not supported for hybrid models; "
                             "turn one of them off")
        B, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S, device=input_ids.device).expand(B, S)
        tree = TreeScan.build(_kv_end(attention_mask, B, S, input_ids.device))
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary(position_ids, x.dtype)
        moe = [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoE)]
        for slot, m in enumerate(moe):
            m.replay = None if routed_experts is None else routed_experts[:, :, slot].reshape(B * S, -1)
        try:
            for layer in self.model.layers:
                x = checkpoint(layer, x, cos, sin, attention_mask, tree, use_reentrant=False) if recompute \
                    else layer(x, cos, sin, attention_mask, tree)
        finally:
            for m in moe:
                m.replay = None
        return self.model.norm(x)

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None, attention_mask=None,
                routed_experts: Tensor | None = None) -> Tensor:
        return self.lm_head(self.hidden(input_ids, position_ids, attention_mask, routed_experts))


def _kv_end(mask, B: int, S: int, device) -> Tensor:
    if isinstance(mask, TreeMask):
        return mask.kv_end
    if mask is None:
        return torch.full((B, S), S, dtype=torch.long, device=device)
    kv_end = kv_end_from_mask(mask)
    if kv_end is None:
        raise ValueError("a hybrid (Gated DeltaNet) model needs a tree-shaped attention mask (each key "
                         "seen by one contiguous run of queries from itself); this mask is not one")
    return kv_end


def lm_class(config: dict) -> type[Qwen2LM]:
    """The embedded trainer's module class for a config.json dict."""
    return HybridLM if ModelSpec(config).hybrid else Qwen2LM
