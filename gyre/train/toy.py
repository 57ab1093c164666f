"""Small random Qwen2 models built in code, for tests and benchmarks (never a model hub).

The init std is deliberately large: with the usual 0.02 attention is nearly uniform, which hides
RoPE, mask and weight-layout bugs behind tiny logit differences.
"""

from __future__ import annotations

import torch


def tiny_qwen2_config(*, vocab_size: int = 96, hidden_size: int = 64, layers: int = 2,
                      heads: int = 4, kv_heads: int = 2, intermediate_size: int = 128,
                      tie_word_embeddings: bool = False):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=tie_word_embeddings, attn_implementation="eager",
        initializer_range=0.02,
    )


def random_qwen2(config=None, *, seed: int = 0, std: float = 0.3):
    """A Qwen2ForCausalLM with seeded N(0, std) weights (norm weights around 1), float32, eval."""
    from transformers import Qwen2ForCausalLM

    config = config or tiny_qwen2_config()
    config._attn_implementation = "eager"  # exact tree masks need a float mask; eager is exact
    model = Qwen2ForCausalLM(config)
    return _seeded(model, seed, std)


# --- every family of gyre.model ---------------------------------------------------------------

FAMILY_CLASSES = {  # model_type -> (transformers config class, causal-LM class)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
}
MODEL_TYPE_FAMILY = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}
# hybrid families: Gated DeltaNet layers with 2 key heads of 8 and 4 value heads of 8 (grouped
# like Qwen3-Next's 16 / 32), every fourth layer full attention
HYBRID_SHAPE = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                    linear_value_head_dim=8, linear_conv_kernel_dim=4)


def tiny_config(family: str, *, vocab_size: int = 96, hidden_size: int = 64, layers: int = 2,
                heads: int = 4, kv_heads: int = 2, intermediate_size: int = 128,
                tie_word_embeddings: bool = False, experts: int = 4, top_k: int = 2,
                moe_intermediate_size: int = 32, **extra):
    """A tiny transformers config of `family` (MoE families: `experts` experts, top-`top_k`)."""
    import transformers

    if family not in FAMILY_CLASSES:
        raise ValueError(f"family {family!r}: choose one of {', '.join(FAMILY_CLASSES)}")
    kw = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
              num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
              max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=tie_word_embeddings,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, initializer_range=0.02,
              hidden_act="silu")
    hybrid = family in ("qwen3_next", "qwen3_5", "qwen3_5_moe")
    if family in ("qwen3", "qwen3_moe") or hybrid:
        kw["head_dim"] = hidden_size // heads
    if hybrid:
        kw |= HYBRID_SHAPE
        kw["num_hidden_layers"] = max(layers, 4)  # at least one full-attention layer
        kw["rope_parameters"] |= {"partial_rotary_factor": 0.5}
    if family in ("qwen3_moe", "qwen2_moe", "qwen3_next"):
        kw |= dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_intermediate_size,
                   norm_topk_prob=family != "qwen2_moe", decoder_sparse_step=1, mlp_only_layers=[])
    if family == "qwen3_5_moe":
        kw |= dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_intermediate_size)
    if family in ("qwen2_moe", "qwen3_next", "qwen3_5_moe"):
        kw["shared_expert_intermediate_size"] = 2 * moe_intermediate_size
    kw |= extra
    cfg = getattr(transformers, FAMILY_CLASSES[family][0])(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def random_model(config, *, seed: int = 0, std: float = 0.3):
    """A transformers causal LM of the config's family with seeded N(0, std) weights (norm
    weights around 1), float32, eval."""
    import transformers

    family = MODEL_TYPE_FAMILY.get(config.model_type, config.model_type)
    model = getattr(transformers, FAMILY_CLASSES[family][1])(config)
    model.config._attn_implementation = "eager"
    return _seeded(model, seed, std)


def _seeded(model, seed: int, std: float):
    """Seeded N(0, std) weights, norm weights around 1; float32, eval (one init for every family)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * std
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else noise)
    return model.float().eval()
