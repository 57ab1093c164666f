"""A transformers-layout model directory, read without transformers: ``config.json`` into a
`ModelSpec` (the shapes a forward needs) and ``*.safetensors`` checked against it.

Shared by the embedded engine (gyre.engine.qwen) and the embedded trainer (gyre.train.qwen2), so
both serve and train exactly what the directory holds; so are RoPE's frequencies and rotation. Why not transformers' ``AutoConfig``/
``from_pretrained``: importing its model code costs ~3 CPU-s per process, paid by every engine and
trainer start (many per test job), for a format this small.

Supported: ``model_type`` qwen2 (q/k/v biases) and llama (``attention_bias``), default RoPE
(no scaling), no sliding window.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file


class ModelFormatError(ValueError):
    """The model directory cannot be used by the embedded engine or trainer (architecture, names or
    shapes)."""


def _rope_theta(cfg: dict) -> float:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", None):
        raise ModelFormatError(f"rope type {kind!r} is not supported by the embedded engine and trainer (only default)")
    return float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))


class ModelSpec:
    """The shapes the forward needs, read from ``config.json``."""

    def __init__(self, cfg: dict):
        kind = cfg.get("model_type")
        if kind not in ("qwen2", "llama"):
            raise ModelFormatError(f"model_type {kind!r} is not supported (qwen2 or llama)")
        if cfg.get("use_sliding_window"):
            raise ModelFormatError("sliding-window attention is not supported by the embedded engine and trainer")
        self.raw = cfg
        self.vocab_size = int(cfg["vocab_size"])
        self.hidden = int(cfg["hidden_size"])
        self.layers = int(cfg["num_hidden_layers"])
        self.heads = int(cfg["num_attention_heads"])
        self.kv_heads = int(cfg.get("num_key_value_heads") or self.heads)
        self.head_dim = int(cfg.get("head_dim") or self.hidden // self.heads)
        self.eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.theta = _rope_theta(cfg)
        self.max_positions = int(cfg.get("max_position_embeddings", 32768))
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        self.qkv_bias = kind == "qwen2" or bool(cfg.get("attention_bias", False))
        eos = cfg.get("eos_token_id")
        self.eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))

    def inv_freq(self) -> torch.Tensor:
        """RoPE's inverse frequencies (float32), as transformers computes them for default RoPE."""
        d = self.head_dim
        return 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        h, d, kv, inter = self.hidden, self.head_dim, self.kv_heads, int(self.raw["intermediate_size"])
        shapes = {"model.embed_tokens.weight": (self.vocab_size, h), "model.norm.weight": (h,)}
        if not self.tied:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        for i in range(self.layers):
            p = f"model.layers.{i}."
            shapes |= {
                p + "self_attn.q_proj.weight": (self.heads * d, h), p + "self_attn.k_proj.weight": (kv * d, h),
                p + "self_attn.v_proj.weight": (kv * d, h), p + "self_attn.o_proj.weight": (h, self.heads * d),
                p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
                p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            }
            if self.qkv_bias:
                shapes |= {p + "self_attn.q_proj.bias": (self.heads * d,),
                           p + "self_attn.k_proj.bias": (kv * d,), p + "self_attn.v_proj.bias": (kv * d,)}
        return shapes


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the last dimension (cos/sin broadcast against x): the rotation the
    embedded engine's and trainer's forwards both apply."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def read_spec(model_dir: str | Path) -> ModelSpec:
    path = Path(model_dir) / "config.json"
    try:
        return ModelSpec(json.loads(path.read_text(encoding="utf-8")))
    except FileNotFoundError:
        raise ModelFormatError(f"{path} does not exist") from None
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path}: unreadable config ({e})") from None


def load_weights(model_dir: str | Path, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """All tensors of the directory, checked against the spec's names and shapes, as float32."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{model_dir}: no *.safetensors file")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors |= load_file(str(f))
    return checked_weights(spec, tensors, f"{model_dir}: ")


def checked_weights(spec: ModelSpec, tensors: dict[str, torch.Tensor], where: str = "") -> dict[str, torch.Tensor]:
    """`tensors` (transformers names) checked against the spec: exactly the expected names (a tied
    head's ``lm_head.weight`` and RoPE buffers are dropped) and shapes; returned as float32."""
    tensors = dict(tensors)
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
