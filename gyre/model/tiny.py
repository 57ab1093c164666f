"""The embedded tiny model: a random transformers model (``Qwen2ForCausalLM`` by default, or any
family of `gyre.model`, e.g. ``Qwen3MoeForCausalLM``) built offline in seconds.

``gyre make-model [--family F] [--out DIR]`` (:mod:`gyre.model.cli`) or :func:`ensure_tiny_model`
writes, atomically (temporary directory + rename), a transformers model directory with
transformers' own ``save_pretrained``: ``config.json``, ``model.safetensors``, ``tokenizer.json``
(the committed ``gyre/assets/tokenizer.json``) and ``gyre_identity.json`` (:mod:`gyre.model.identity`).

The weights are drawn from N(0, 0.15) (biases and norm gains too, around 0 and 1) with a fixed
seed: a non-tiny std keeps attention far from uniform, so a wrong RoPE, mask or weight layout
changes logits visibly in tests.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from tokenizers import Tokenizer

from gyre.model.build_tokenizer import ASSET as TOKENIZER_ASSET
from gyre.model.families import MODEL_TYPES
from gyre.model.identity import IDENTITY_FILE, write_identity
from gyre.model.tokenizer import special_ids

NAME = "gyre-tiny-qwen"
SEED = 20251129
INIT_STD = 0.15
# Enough to build config.json; vocab_size is added from the tokenizer.
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-6)
HEAD_DIM = 16  # the default variant's attention head size
SERVING_HEAD_DIM = 32  # the variant vLLM's CPU attention can serve (it needs head size >= 32)
MAX_POSITIONS = 32768  # the default variant; `gyre make-model --max-positions 262144` builds a long one
LONG_POSITIONS = 262144  # xLong contexts (issue 28): the long variant serves at least this
ROPE_THETA = 10000.0
# per family, on top of TINY_SHAPE: Qwen3 sets head_dim explicitly; MoE families route each
# token to 2 of 8 small experts (Qwen3-30B-A3B: 8 of 128)
FAMILY_SHAPE = {
    "qwen2": {}, "llama": {}, "qwen3": dict(head_dim=16),
    "qwen3_moe": dict(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, norm_topk_prob=False, decoder_sparse_step=1,
                      mlp_only_layers=[]),
}
# hybrid families: 4 layers, Gated DeltaNet in the first three and full attention in the fourth
# (Qwen3.5's every-fourth pattern), 2 key / 4 value heads of 8 in the linear layers, partial RoPE
_HYBRID = dict(num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4)
_HYBRID_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=64)
FAMILY_SHAPE |= {
    "qwen3_next": _HYBRID | _HYBRID_MOE | dict(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen3_5": dict(_HYBRID), "qwen3_5_moe": _HYBRID | _HYBRID_MOE,
}
HYBRID_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
CONFIG_CLASS = {"qwen2": "Qwen2Config", "llama": "LlamaConfig", "qwen3": "Qwen3Config",
                "qwen3_moe": "Qwen3MoeConfig", "qwen2_moe": "Qwen2MoeConfig", "qwen3_next": "Qwen3NextConfig",
                "qwen3_5": "Qwen3_5TextConfig", "qwen3_5_moe": "Qwen3_5MoeTextConfig"}


def tiny_name(family: str, max_positions: int = MAX_POSITIONS, head_dim: int = HEAD_DIM) -> str:
    name = NAME if family == "qwen2" else f"gyre-tiny-{family.replace('_', '-')}"
    name = name if max_positions == MAX_POSITIONS else f"{name}-ctx{max_positions}"
    return name if head_dim == HEAD_DIM else f"{name}-hd{head_dim}"


def _head_shape(family: str, head_dim: int) -> dict:
    """The shape keys that give attention heads of ``head_dim`` (the same head counts): families
    without an explicit ``head_dim`` key widen the hidden size to heads x head_dim."""
    if head_dim == HEAD_DIM:
        return {}
    shape = TINY_SHAPE | FAMILY_SHAPE[family]
    if "head_dim" in shape:
        return {"head_dim": head_dim}
    return {"hidden_size": shape["num_attention_heads"] * head_dim}


def _build(dst: Path, family: str = "qwen2", max_positions: int = MAX_POSITIONS, head_dim: int = HEAD_DIM) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    tok = Tokenizer.from_file(str(TOKENIZER_ASSET))
    ids = special_ids(tok)
    vocab = -(-tok.get_vocab_size() // 64) * 64
    rope = {"rope_type": "default", "rope_theta": ROPE_THETA}
    if family in HYBRID_FAMILIES:  # strict configs: no sliding-window key
        extra, rope = {}, rope | {"partial_rotary_factor": 0.5}
    else:
        extra = {} if family == "llama" else {"use_sliding_window": False}
    config = getattr(transformers, CONFIG_CLASS[family])(
        vocab_size=vocab, tie_word_embeddings=False, hidden_act="silu", initializer_range=INIT_STD,
        rope_parameters=rope, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"], max_position_embeddings=max_positions,
        **(TINY_SHAPE | FAMILY_SHAPE[family] | _head_shape(family, head_dim) | extra),
    )
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    # Fill every tensor ourselves, in name order, from one generator: the result depends only on
    # torch's generator, not on transformers' init code (which changes between versions).
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * INIT_STD
            p.copy_(noise + 1.0 if name.endswith("norm.weight") else noise)
    model.save_pretrained(dst)
    shutil.copyfile(TOKENIZER_ASSET, dst / "tokenizer.json")
    write_identity(dst, tiny_name(family, max_positions, head_dim))


def head_dim_of(config: dict) -> int:
    """The attention head size a model's ``config.json`` gives (explicit, or hidden / heads)."""
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def ensure_tiny_model(out_dir: str | os.PathLike, family: str = "qwen2", max_positions: int = MAX_POSITIONS,
                      head_dim: int = HEAD_DIM) -> Path:
    """Build the tiny model of `family` in ``out_dir`` unless a complete one is there; return its
    path (a complete directory of another family, RoPE range or head size is refused, not
    overwritten). ``max_positions``: its context (default RoPE needs no scaling; the weights are
    the same). ``head_dim``: 16 by default; ``SERVING_HEAD_DIM`` (32) builds the variant vLLM's CPU
    attention serves (same families and head counts, wider heads)."""
    if head_dim not in (HEAD_DIM, SERVING_HEAD_DIM):
        raise ValueError(f"head_dim {head_dim}: choose {HEAD_DIM} (default) or {SERVING_HEAD_DIM} (servable by vLLM on CPU)")
    if family not in FAMILY_SHAPE:
        raise ValueError(f"family {family!r}: choose one of {', '.join(FAMILY_SHAPE)}")
    if max_positions < 1024:
        raise ValueError(f"max_positions {max_positions}: a context of at least 1024 tokens is needed")
    out_dir = Path(out_dir)
    if (out_dir / IDENTITY_FILE).exists():
        cfg = json.loads((out_dir / "config.json").read_text(encoding="utf-8"))
        found, positions = cfg.get("model_type"), cfg.get("max_position_embeddings")
        found = MODEL_TYPES.get(found, found)  # Qwen3.5's text-only model writes qwen3_5[_moe]_text
        if found != family:
            raise ValueError(f"{out_dir} holds a {found} model, not {family}; pass another --out "
                             f"(or model.tiny_dir) for the {family} model")
        if positions != max_positions:
            raise ValueError(f"{out_dir} holds a model of {positions} positions, not {max_positions}; pass "
                             f"another --out for the {max_positions}-position model")
        if head_dim_of(cfg) != head_dim:
            raise ValueError(f"{out_dir} holds a model of head size {head_dim_of(cfg)}, not {head_dim}; pass "
                             f"another --out for the head size {head_dim} model")
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        _build(tmp, family, max_positions, head_dim)
        try:  # not fsio.atomic_dir: the first builder wins here (a cache, rebuilt if lost)
            tmp.rename(out_dir)
        except OSError:
            # Another process finished first (rename onto a non-empty dir fails): keep theirs.
            if not (out_dir / IDENTITY_FILE).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
