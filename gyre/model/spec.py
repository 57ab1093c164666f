"""A transformers-layout model directory, read without transformers: ``config.json`` into a
`ModelSpec` (the shapes a forward needs, by family) and ``*.safetensors`` checked against it.

Shared by the embedded engine (gyre.engine.qwen) and the embedded trainer (gyre.train.qwen2), so
both serve and train exactly what the directory holds; so are RoPE's frequencies and rotation. Why
not transformers' ``AutoConfig``/``from_pretrained``: importing its model code costs ~3 CPU-s per
process, paid by every engine and trainer start (many per test job), for a format this small.

Expert weights are named as transformers' ``save_pretrained`` writes them (and as hub checkpoints
ship them): ``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight``. transformers 5 holds
them fused in memory (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj``
``[E, H, I]``); `checked_weights` accepts that layout too and splits it (`split_fused_experts`).

Default RoPE only (no scaling), no sliding window. Every layer is full attention, except in the
hybrid families (Qwen3-Next, Qwen3.5: `Family.hybrid`), whose ``layer_types`` mix Gated DeltaNet
(``linear_attention``) layers with output-gated full-attention layers (partial RoPE on the first
``rotary_dim`` dimensions of each head; docs/hybrid-layers.md).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from gyre.model.families import Family, ModelFormatError, family_of, read_config, text_config


LINEAR, FULL = "linear_attention", "full_attention"


def _rope_theta(cfg: dict) -> float:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    # Qwen3.5's multimodal RoPE sections coincide with default RoPE for text (one position per token)
    if kind not in ("default", None):
        raise ModelFormatError(f"rope type {kind!r} is not supported by the embedded engine and trainer (only default)")
    return float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))


class ModelSpec:
    """The shapes the forward needs, read from ``config.json``."""

    def __init__(self, cfg: dict):
        cfg = text_config(cfg)
        self.family: Family = family_of(cfg)
        if cfg.get("use_sliding_window"):
            raise ModelFormatError("sliding-window attention is not supported by the embedded engine and trainer")
        self.layers = int(cfg["num_hidden_layers"])
        self.layer_types = _layer_types(cfg, self.family, self.layers)
        if cfg.get("mlp_bias"):
            raise ModelFormatError("mlp_bias=true is not supported (no family Gyre serves has MLP biases)")
        f = self.family
        self.raw = cfg
        self.vocab_size = int(cfg["vocab_size"])
        self.hidden = int(cfg["hidden_size"])
        self.heads = int(cfg["num_attention_heads"])
        self.kv_heads = int(cfg.get("num_key_value_heads") or self.heads)
        self.head_dim = int(cfg.get("head_dim") or self.hidden // self.heads)
        self.eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.theta = _rope_theta(cfg)
        rope = cfg.get("rope_parameters") or {}
        partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
        self.rotary_dim = int(self.head_dim * partial)  # RoPE on the first rotary_dim of each head
        self.hybrid = f.hybrid  # output-gated attention, (1 + weight) RMSNorms, Gated DeltaNet layers
        if self.hybrid:
            self.lin_k_heads = int(cfg["linear_num_key_heads"])
            self.lin_v_heads = int(cfg["linear_num_value_heads"])
            self.lin_k_dim = int(cfg["linear_key_head_dim"])
            self.lin_v_dim = int(cfg["linear_value_head_dim"])
            self.conv_kernel = int(cfg["linear_conv_kernel_dim"])
            if self.lin_v_heads % self.lin_k_heads:
                raise ModelFormatError(f"linear_num_value_heads={self.lin_v_heads} must be a multiple of "
                                       f"linear_num_key_heads={self.lin_k_heads}")
        self.max_positions = int(cfg.get("max_position_embeddings", 32768))
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        self.qkv_bias = bool(cfg.get(f.qkv_bias_key, f.qkv_bias_default)) if f.qkv_bias_key else f.qkv_bias_default
        self.qk_norm = f.qk_norm
        self.intermediate = int(cfg["intermediate_size"])
        # routed experts (0 = dense); which layers are sparse follows transformers' rule
        self.experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0) if f.moe else 0
        self.moe_layers: frozenset[int] = frozenset()
        if self.experts:
            self.top_k = int(cfg["num_experts_per_tok"])
            self.moe_intermediate = int(cfg["moe_intermediate_size"])
            self.norm_topk_prob = bool(cfg.get("norm_topk_prob", f.norm_topk_default))
            step, dense = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or [])
            self.moe_layers = frozenset(i for i in range(self.layers) if i not in dense and (i + 1) % step == 0)
            if not 0 < self.top_k <= self.experts:
                raise ModelFormatError(f"num_experts_per_tok={self.top_k} must be in 1..{self.experts}")
        self.shared_intermediate = int(cfg.get("shared_expert_intermediate_size") or 0) if f.shared_expert else 0
        eos = cfg.get("eos_token_id")
        self.eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))

    @property
    def model_type(self) -> str:
        return self.family.name

    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers

    def is_linear(self, layer: int) -> bool:
        """A Gated DeltaNet layer (recurrent state, no KV)."""
        return self.layer_types[layer] == LINEAR

    @property
    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    @property
    def conv_dim(self) -> int:
        """Channels of a Gated DeltaNet layer's short convolution (q, k, v)."""
        return 2 * self.lin_k_heads * self.lin_k_dim + self.lin_v_heads * self.lin_v_dim

    def inv_freq(self) -> torch.Tensor:
        """RoPE's inverse frequencies (float32), as transformers computes them for default RoPE
        (over `rotary_dim`: the whole head unless the config sets a partial_rotary_factor)."""
        d = self.rotary_dim
        return 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        h = self.hidden
        shapes = {"model.embed_tokens.weight": (self.vocab_size, h), "model.norm.weight": (h,)}
        if not self.tied:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        for i in range(self.layers):
            p = f"model.layers.{i}."
            shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
            if self.is_linear(i):
                shapes |= self._linear_attn_shapes(p + "linear_attn.")
            else:
                shapes |= self._attn_shapes(p + "self_attn.")
            if self.is_moe(i):
                shapes[p + "mlp.gate.weight"] = (self.experts, h)
                for e in range(self.experts):
                    shapes |= _mlp_shapes(f"{p}mlp.experts.{e}.", h, self.moe_intermediate)
                if self.shared_intermediate:
                    shapes |= _mlp_shapes(p + "mlp.shared_expert.", h, self.shared_intermediate)
                    shapes[p + "mlp.shared_expert_gate.weight"] = (1, h)
            else:
                shapes |= _mlp_shapes(p + "mlp.", h, self.intermediate)
        return shapes

    def _attn_shapes(self, p: str) -> dict[str, tuple[int, ...]]:
        h, d, kv = self.hidden, self.head_dim, self.kv_heads
        q_rows = self.heads * d * (2 if self.hybrid else 1)  # hybrid: query and output gate
        shapes = {p + "q_proj.weight": (q_rows, h), p + "k_proj.weight": (kv * d, h),
                  p + "v_proj.weight": (kv * d, h), p + "o_proj.weight": (h, self.heads * d)}
        if self.qkv_bias:
            shapes |= {p + "q_proj.bias": (q_rows,), p + "k_proj.bias": (kv * d,), p + "v_proj.bias": (kv * d,)}
        if self.qk_norm:
            shapes |= {p + "q_norm.weight": (d,), p + "k_norm.weight": (d,)}
        return shapes

    def _linear_attn_shapes(self, p: str) -> dict[str, tuple[int, ...]]:
        h, nv = self.hidden, self.lin_v_heads
        key, value = self.lin_k_heads * self.lin_k_dim, nv * self.lin_v_dim
        if self.family.gdn_fused_proj:
            proj = {p + "in_proj_qkvz.weight": (2 * key + 2 * value, h), p + "in_proj_ba.weight": (2 * nv, h)}
        else:
            proj = {p + "in_proj_qkv.weight": (2 * key + value, h), p + "in_proj_z.weight": (value, h),
                    p + "in_proj_b.weight": (nv, h), p + "in_proj_a.weight": (nv, h)}
        return proj | {p + "conv1d.weight": (self.conv_dim, 1, self.conv_kernel), p + "dt_bias": (nv,),
                       p + "A_log": (nv,), p + "norm.weight": (self.lin_v_dim,), p + "out_proj.weight": (h, value)}


def _layer_types(cfg: dict, family: Family, layers: int) -> list[str]:
    """Each layer's kind: full attention everywhere, or a hybrid family's ``layer_types`` (when
    absent, transformers' rule: every ``full_attention_interval``-th layer is full attention)."""
    types = cfg.get("layer_types")
    if not family.hybrid:
        if any(t != FULL for t in types or []):
            raise ModelFormatError(f"layer_types {sorted(set(types))}: only full_attention layers are "
                                   f"supported by {family.name}")
        return [FULL] * layers
    if types is None:
        every = int(cfg.get("full_attention_interval", 4))
        types = [FULL if (i + 1) % every == 0 else LINEAR for i in range(layers)]
    if len(types) != layers or set(types) - {FULL, LINEAR}:
        raise ModelFormatError(f"layer_types must list {layers} entries of {FULL!r} or {LINEAR!r}, got {types}")
    return list(types)


def _mlp_shapes(prefix: str, h: int, inter: int) -> dict[str, tuple[int, int]]:
    return {prefix + "gate_proj.weight": (inter, h), prefix + "up_proj.weight": (inter, h),
            prefix + "down_proj.weight": (h, inter)}


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the last dimension (cos/sin broadcast against x): the rotation the
    embedded engine's and trainer's forwards both apply."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalised in float32, cast back, then scaled."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def read_spec(model_dir: str | Path) -> ModelSpec:
    path = Path(model_dir) / "config.json"
    cfg = read_config(model_dir)
    try:
        return ModelSpec(cfg)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ModelFormatError):
            raise ModelFormatError(f"{path}: {e}") from None
        raise ModelFormatError(f"{path}: unreadable config ({type(e).__name__}: {e})") from None


def load_weights(model_dir: str | Path, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """All tensors of the directory, checked against the spec's names and shapes, as float32."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{model_dir}: no *.safetensors file")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors |= load_file(str(f))
    return checked_weights(spec, tensors, f"{model_dir}: ")


_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)$")


def split_fused_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's in-memory expert tensors (``experts.gate_up_proj`` ``[E, 2I, H]``, gate
    rows first; ``experts.down_proj`` ``[E, H, I]``) as the per-expert names checkpoints use."""
    out = {}
    for name, t in tensors.items():
        m = _FUSED.match(name)
        if not m:
            out[name] = t
            continue
        prefix, kind = m.groups()
        for e in range(t.shape[0]):
            if kind == "down_proj":
                out[f"{prefix}{e}.down_proj.weight"] = t[e]
            else:
                gate, up = t[e].chunk(2, dim=0)
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = gate, up
    return out


def checked_weights(spec: ModelSpec, tensors: dict[str, torch.Tensor], where: str = "") -> dict[str, torch.Tensor]:
    """`tensors` (transformers names) checked against the spec: exactly the expected names (a tied
    head's ``lm_head.weight`` and RoPE buffers are dropped; fused experts are split) and shapes;
    returned as float32."""
    tensors = split_fused_experts(tensors)
    if spec.tied:
        tensors.pop("lm_head.weight", None)
    expected = spec.expected_shapes()
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(n for n in set(tensors) - set(expected) if not n.endswith("rotary_emb.inv_freq"))
    if missing or extra:
        raise ModelFormatError(f"{where}tensor names do not match config.json "
                               f"(missing {missing[:5]}, unexpected {extra[:5]})")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ModelFormatError(f"{where}{name} has shape {tuple(tensors[name].shape)}, expected {shape}")
    return {n: tensors[n].to(torch.float32).contiguous() for n in expected}
