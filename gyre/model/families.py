"""Which model families Gyre serves and trains, read from ``config.json``'s ``model_type``.

One table: each family says what its layers hold (q/k/v biases, q/k RMSNorm, routed experts,
a shared expert, hybrid Gated DeltaNet layers). Everything family-specific elsewhere (shapes, the HF <-> Megatron name map,
the engine's and trainer's forwards, parameter counts) reads a `Family` from here, so adding a
family is one row plus whatever new layer it brings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class ModelFormatError(ValueError):
    """The model directory cannot be used by the embedded engine or trainer (architecture, names or
    shapes)."""


@dataclass(frozen=True)
class Family:
    name: str
    qkv_bias_key: str | None   # config key that turns q/k/v biases on (None: never)
    qkv_bias_default: bool     # value when the key is absent
    qk_norm: bool              # RMSNorm over each head's queries and keys before RoPE (Qwen3)
    moe: bool                  # routed experts in (some) MLPs
    shared_expert: bool        # a sigmoid-gated shared expert beside the routed ones (Qwen2-MoE)
    # Hybrid (Qwen3-Next, Qwen3.5): `layer_types` mixes Gated DeltaNet ("linear_attention") and
    # output-gated full-attention layers; RMSNorms scale by (1 + weight); partial RoPE.
    hybrid: bool = False
    gdn_fused_proj: bool = False    # Qwen3-Next: in_proj_qkvz / in_proj_ba grouped by key head
    norm_topk_default: bool = False  # norm_topk_prob when config.json omits it (Qwen3.5-MoE: always)


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("qwen2", None, True, qk_norm=False, moe=False, shared_expert=False),
    Family("llama", "attention_bias", False, qk_norm=False, moe=False, shared_expert=False),
    Family("qwen3", "attention_bias", False, qk_norm=True, moe=False, shared_expert=False),
    Family("qwen3_moe", "attention_bias", False, qk_norm=True, moe=True, shared_expert=False),
    Family("qwen2_moe", "qkv_bias", True, qk_norm=False, moe=True, shared_expert=True),
    Family("qwen3_next", "attention_bias", False, qk_norm=True, moe=True, shared_expert=True,
           hybrid=True, gdn_fused_proj=True),
    Family("qwen3_5", "attention_bias", False, qk_norm=True, moe=False, shared_expert=False, hybrid=True),
    Family("qwen3_5_moe", "attention_bias", False, qk_norm=True, moe=True, shared_expert=True,
           hybrid=True, norm_topk_default=True),
)}

# model_type -> family where they differ: Qwen3.5's text-only causal LM writes ``*_text``; the
# multimodal checkpoint's top-level type names the family and nests the text model's config in
# ``text_config`` (`text_config` unwraps it).
MODEL_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}
HYBRID = tuple(sorted(n for n, f in FAMILIES.items() if f.hybrid))


def supported() -> list[str]:
    return sorted(FAMILIES)


def text_config(cfg: dict) -> dict:
    """The language model's config of a config.json dict: ``text_config`` of a multimodal Qwen3.5
    checkpoint (which carries the family's own model_type), else the dict itself."""
    inner = cfg.get("text_config")
    if cfg.get("model_type") in FAMILIES and isinstance(inner, dict):
        return {**inner, "model_type": cfg["model_type"]}
    return cfg


def family_of(cfg: dict) -> Family:
    """The family of a config.json dict, or ModelFormatError naming the supported ones."""
    kind = cfg.get("model_type")
    kind = MODEL_TYPES.get(kind, kind)
    if kind not in FAMILIES:
        raise ModelFormatError(f"model_type {kind!r} is not supported; supported families: "
                               f"{', '.join(supported())}")
    return FAMILIES[kind]


# here, not in spec.py (which needs torch): launchers read a config without importing torch
def read_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelFormatError(f"{path} does not exist") from None
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{path}: unreadable config ({e})") from None
    if not isinstance(cfg, dict):
        raise ModelFormatError(f"{path}: not a JSON object")
    return cfg
