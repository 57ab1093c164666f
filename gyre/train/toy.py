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
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * std
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else noise)
    return model.float().eval()
