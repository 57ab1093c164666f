"""Which model families Gyre serves and trains, read from ``config.json``'s ``model_type``.

One table: each family says what its layers hold (q/k/v biases, q/k RMSNorm, routed experts,
a shared expert). Everything family-specific elsewhere (shapes, the HF <-> Megatron name map,
the engine's and trainer's forwards, parameter counts) reads a `Family` from here, so adding a
family is one row plus whatever new layer it brings.
"""

from __future__ import annotations

from dataclasses import dataclass


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


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("qwen2", None, True, qk_norm=False, moe=False, shared_expert=False),
    Family("llama", "attention_bias", False, qk_norm=False, moe=False, shared_expert=False),
    Family("qwen3", "attention_bias", False, qk_norm=True, moe=False, shared_expert=False),
    Family("qwen3_moe", "attention_bias", False, qk_norm=True, moe=True, shared_expert=False),
    Family("qwen2_moe", "qkv_bias", True, qk_norm=False, moe=True, shared_expert=True),
)}

# Hybrid linear-attention families: a Gated DeltaNet layer carries a recurrent state instead of a
# KV cache, which a token tree cannot share by prefix (docs/hybrid-layers.md says how it could).
HYBRID = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text")


def supported() -> list[str]:
    return sorted(FAMILIES)


def family_of(cfg: dict) -> Family:
    """The family of a config.json dict, or ModelFormatError naming the supported ones."""
    kind = cfg.get("model_type")
    if kind in HYBRID:
        raise ModelFormatError(
            f"model_type {kind!r} has hybrid Gated DeltaNet (linear-attention) layers, whose recurrent "
            f"state cannot be shared along a trajectory tree's prefixes; Gyre does not serve or train it "
            f"yet (docs/hybrid-layers.md). Supported: {', '.join(supported())}")
    if kind not in FAMILIES:
        raise ModelFormatError(f"model_type {kind!r} is not supported; supported families: "
                               f"{', '.join(supported())}")
    return FAMILIES[kind]
