"""The embedded trainer's model: a decoder of any `gyre.model` family (Qwen2, Llama, Qwen3,
Qwen3-MoE, Qwen2-MoE) as a torch module, transformers' maths.

Parameter names are the checkpoint's (``model.layers.0.self_attn.q_proj.weight``,
``model.layers.0.mlp.experts.3.up_proj.weight``, ...), so state dicts, checkpoints and exported
weights are interchangeable with transformers' ``save_pretrained`` directories; the forward is
transformers' op for op (RMSNorm in float32, rotate-half RoPE from position ids, grouped-query
attention, q/k RMSNorm for Qwen3, SiLU-gated MLP or top-k routed experts), which
`tests/train/test_train_qwen2.py` and `tests/model/test_model_families.py` check logits and gradients against. Attention takes what the micro-batch carries: a `TreeMask` (the tree path), a
bool ``[B, 1, S, S]`` mask (True = masked; the dense path) or None (causal).

Why not transformers' ``AutoModelForCausalLM``: importing its model code costs ~3-4 CPU-s in every
trainer process (transformers 5 scans its package to build the lazy import table), and a job
starts one per trainer rank and again after every restart; the module itself is 100 lines.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from gyre.model.moe import route, tokens_per_expert
from gyre.model.spec import ModelSpec, apply_rope, checked_weights, load_weights, read_spec, rms_norm
from gyre.train.tree_attention import attention, keep_attention_on_recompute


# Weights always come from a state dict (`Qwen2LM.from_state`), so layers skip their random init
# (seconds for a large model): uninitialised storage is free and is replaced at once.
class Linear(nn.Linear):
    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, d = spec.hidden, spec.head_dim
        self.heads, self.kv_heads, self.head_dim = spec.heads, spec.kv_heads, d
        self.q_proj = Linear(h, spec.heads * d, bias=spec.qkv_bias)
        self.k_proj = Linear(h, spec.kv_heads * d, bias=spec.qkv_bias)
        self.v_proj = Linear(h, spec.kv_heads * d, bias=spec.qkv_bias)
        self.o_proj = Linear(spec.heads * d, h, bias=False)
        if spec.qk_norm:  # Qwen3: RMSNorm over each head's dimension, before RoPE
            self.q_norm = RMSNorm(d, spec.eps)
            self.k_norm = RMSNorm(d, spec.eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask) -> Tensor:
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.heads, self.head_dim)
        k = self.k_proj(x).view(B, S, self.kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # cos/sin [B, 1, S, D]
        out = attention(q, k, v, mask, self.head_dim ** -0.5)            # [B, H, S, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, S, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, inter: int | None = None) -> None:
        super().__init__()
        inter = inter or spec.intermediate
        self.gate_proj = Linear(spec.hidden, inter, bias=False)
        self.up_proj = Linear(spec.hidden, inter, bias=False)
        self.down_proj = Linear(inter, spec.hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """Top-k routed experts (`gyre.model.moe.route`), plus a sigmoid-gated shared expert where the
    family has one. Each forward in training mode leaves its load-balancing loss in `aux_loss`
    (Switch Transformer's E * sum_e f_e * P_e over the forward's tokens, as transformers'
    ``load_balancing_loss_func``); the trainer adds it with ``train.moe_aux_loss_coef``."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob, self.n_experts = spec.top_k, spec.norm_topk_prob, spec.experts
        self.gate = Linear(spec.hidden, spec.experts, bias=False)
        self.experts = nn.ModuleList(MLP(spec, spec.moe_intermediate) for _ in range(spec.experts))
        if spec.shared_intermediate:
            self.shared_expert = MLP(spec, spec.shared_intermediate)
            self.shared_expert_gate = Linear(spec.hidden, 1, bias=False)
        self.aux_loss: Tensor | None = None
        self.last_experts: Tensor | None = None  # [N, k] expert ids of the last forward (stats)
        self.replay: Tensor | None = None  # [N, k] expert ids to use in the next forward (routing replay)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        weights, experts = route(h, self.gate.weight, self.top_k, self.norm_topk_prob, self.replay)
        out = torch.zeros_like(h)
        for e, rows, slot in tokens_per_expert(experts, self.n_experts):
            out = out.index_add(0, rows, self.experts[e](h[rows]) * weights[rows, slot, None])
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)
        self.last_experts = experts.detach()
        if self.training:
            probs = F.softmax(F.linear(h, self.gate.weight), dim=-1, dtype=torch.float32)
            frac = F.one_hot(experts, self.n_experts).float().mean(dim=(0, 1))  # tokens per expert / (N k)
            self.aux_loss = self.n_experts * (frac * probs.mean(0)).sum()
        return out.reshape(shape)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, index: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(spec)
        self.mlp = SparseMoE(spec) if spec.is_moe(index) else MLP(spec)
        self.input_layernorm = RMSNorm(spec.hidden, spec.eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden, spec.eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.layers))
        self.norm = RMSNorm(spec.hidden, spec.eps)
        self.register_buffer("inv_freq", spec.inv_freq(), persistent=False)  # not a weight

    def rotary(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        with torch.autocast(position_ids.device.type, enabled=False):  # angles in float32
            freqs = position_ids[..., None].float() * self.inv_freq.float()
            emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [B, 1, S, D]: broadcast over heads
            return emb.cos().to(dtype), emb.sin().to(dtype)


def _run_layer(layer: DecoderLayer, x: Tensor, cos: Tensor, sin: Tensor, mask, replay: Tensor | None) -> Tensor:
    moe = layer.mlp if isinstance(layer.mlp, SparseMoE) else None
    if moe is not None:
        moe.replay = replay
    try:
        return layer(x, cos, sin, mask)
    finally:
        if moe is not None:
            moe.replay = None


class Qwen2LM(nn.Module):
    """Decoder plus LM head; ``forward`` returns logits ``[B, S, vocab]``."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.spec = ModelSpec(config)
        self.config = dict(config)  # config.json as read: exported back unchanged
        self.model = Decoder(self.spec)
        self.lm_head = Linear(self.spec.hidden, self.spec.vocab_size, bias=False)
        if self.spec.tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None, attention_mask=None,
                routed_experts: Tensor | None = None) -> Tensor:
        """[B, S, vocab] logits (tests, the dense reference): training goes through `hidden` and
        `gyre.train.logprobs`, which project only the target positions."""
        return self.lm_head(self.hidden(input_ids, position_ids, attention_mask, routed_experts))

    def hidden(self, input_ids: Tensor, position_ids: Tensor | None = None, attention_mask=None,
               routed_experts: Tensor | None = None, *, recompute: bool = False) -> Tensor:
        """Final normed hidden states [B, S, hidden]. `routed_experts` ``[B, S, MoE layers,
        top_k]``: replay this routing (what the engine routed each position to) instead of
        routing anew. `recompute`: activation checkpointing per layer (under autograd a layer
        keeps only its input and the CPU tree attention's kernel outputs; backward runs the rest
        again)."""
        B, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S, device=input_ids.device).expand(B, S)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary(position_ids, x.dtype)
        slots = {}
        for layer in self.model.layers:
            if isinstance(layer.mlp, SparseMoE):
                slots[layer] = len(slots)
        recompute = recompute and torch.is_grad_enabled()
        for layer in self.model.layers:
            replay = None
            if routed_experts is not None and layer in slots:
                replay = routed_experts[:, :, slots[layer]].reshape(B * S, -1)
            # the replayed routing is an argument, so a recomputed layer routes as the first pass
            if recompute:
                x = checkpoint(_run_layer, layer, x, cos, sin, attention_mask, replay, use_reentrant=False,
                               context_fn=keep_attention_on_recompute)
            else:
                x = _run_layer(layer, x, cos, sin, attention_mask, replay)
        return self.model.norm(x)

    def moe_aux_loss(self) -> Tensor | None:
        """Sum of the MoE layers' load-balancing losses from the last training forward (None: dense)."""
        losses = [m.aux_loss for m in self.modules() if isinstance(m, SparseMoE) and m.aux_loss is not None]
        return torch.stack(losses).sum() if losses else None

    # --- construction -------------------------------------------------------------------------
    @classmethod
    def from_state(cls, config: dict, state: dict[str, Tensor]) -> "Qwen2LM":
        """A float32 model holding `state` (transformers names; ``lm_head.weight`` optional when
        tied); float32 tensors are used as given, not copied. Raises ModelFormatError naming the
        tensor when names or shapes do not match the config."""
        model = cls(config)
        model._assign(checked_weights(model.spec, {k: v.detach() for k, v in state.items()}))
        return model

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> "Qwen2LM":
        spec = read_spec(model_dir)
        model = cls(spec.raw)
        model._assign(load_weights(model_dir, spec))  # load_weights checks names and shapes
        return model

    def _assign(self, weights: dict[str, Tensor]) -> None:
        """Take checked weights (`checked_weights`) as the parameters, without copying."""
        self.load_state_dict(weights, strict=False, assign=True)  # strict: checked_weights
        if self.spec.tied:  # assign replaced the shared parameter: share it again
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def from_transformers(cls, model) -> "Qwen2LM":
        """A copy of an in-memory transformers model of a supported family (tests, benchmarks);
        transformers 5's fused expert tensors are split into the checkpoint's per-expert names."""
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return cls.from_state(model.config.to_dict(), state)

