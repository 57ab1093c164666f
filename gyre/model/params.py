"""Parameter counts of a model from its ``config.json`` (any supported family), counted from the
exact tensor list the checkpoint must hold (`ModelSpec.expected_shapes`), so they agree with the
weights by construction.

* ``total``: every tensor (a tied head counted once).
* ``expert``: the routed experts' tensors (``mlp.experts.E.*``).
* ``active``: what one token uses: everything but the routed experts, plus top_k / E of them
  (the planner's FLOPs per token and the serving arithmetic use it).
* ``embedding``: the input embedding (a lookup, no FLOPs).
* ``kv_bytes_per_token``: bf16 K and V of the full-attention layers only (``attn_layers``).
* ``state_bytes_per_request``: hybrid families: each Gated DeltaNet layer's recurrent state
  (value heads x d_k x d_v, float32: SGLang's default ``--mamba-ssm-dtype``) and conv window
  (kernel - 1 past inputs of every q/k/v channel, bf16), fixed however long the context; 0 otherwise.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from gyre.model.families import ModelFormatError
from gyre.model.spec import ModelSpec


def param_counts(config: dict | str | Path) -> dict:
    """``{total, active, expert, embedding, model_type, layers, attn_dim}`` of a config dict or a
    config.json path (or a model directory holding one)."""
    if not isinstance(config, dict):
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ModelFormatError(f"{path}: cannot read a model config ({e})") from None
    try:
        spec = ModelSpec(config)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ModelFormatError):
            raise
        raise ModelFormatError(f"model config: missing or bad field ({type(e).__name__}: {e})") from None
    total = expert = 0
    for name, shape in spec.expected_shapes().items():
        n = math.prod(shape)
        total += n
        if ".mlp.experts." in name:
            expert += n
    active = total - expert + (expert * spec.top_k // spec.experts if spec.experts else 0)
    attn_layers = len(spec.full_layers)
    state = 0
    if spec.hybrid:
        per_layer = spec.lin_v_heads * spec.lin_k_dim * spec.lin_v_dim * 4 + (spec.conv_kernel - 1) * spec.conv_dim * 2
        state = len(spec.linear_layers) * per_layer
    return {"model_type": spec.model_type, "total": total, "active": active, "expert": expert,
            "embedding": spec.vocab_size * spec.hidden, "layers": spec.layers, "attn_layers": attn_layers,
            "attn_dim": spec.heads * spec.head_dim, "experts": spec.experts,
            "top_k": spec.top_k if spec.experts else 0,
            "kv_bytes_per_token": attn_layers * 2 * spec.kv_heads * spec.head_dim * 2,
            "state_bytes_per_request": state}
