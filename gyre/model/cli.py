"""``gyre make-model``: build the embedded tiny model of a family offline (:mod:`gyre.model.tiny`).

The one module of `gyre.model` that reads the configuration (where the tiny model goes, which
family); the rest of the package knows nothing of Gyre's other modules.
"""

from __future__ import annotations

import sys
from pathlib import Path

from gyre.config import default_tiny_dir, load_config
from gyre.model.identity import model_identity
from gyre.model.tiny import FAMILY_SHAPE, HEAD_DIM, MAX_POSITIONS, SERVING_HEAD_DIM, ensure_tiny_model


def add_arguments(parser) -> None:
    parser.add_argument("--out", type=Path, default=None,
                        help="model directory (default: model.tiny_dir, or ~/.cache/gyre/tiny-qwen)")
    parser.add_argument("--config", default=None, help="Gyre TOML config file")
    parser.add_argument("--family", default=None, choices=sorted(FAMILY_SHAPE),
                        help="model family (default: model.tiny_family, qwen2)")
    parser.add_argument("--max-positions", type=int, default=MAX_POSITIONS,
                        help=f"context length (max_position_embeddings, default {MAX_POSITIONS}); e.g. 262144 "
                             "for xLong contexts. Another value than the default goes to its own directory "
                             "(<default dir>-ctx<N>) unless --out is given")
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM, choices=(HEAD_DIM, SERVING_HEAD_DIM),
                        help=f"attention head size (default {HEAD_DIM}); {SERVING_HEAD_DIM} builds the variant vLLM's CPU "
                             "attention can serve (engine.backend = vllm), in <default dir>-hd32 unless --out is given")


def run(args) -> int:
    cfg = load_config(getattr(args, "config", None))
    if getattr(args, "family", None):
        cfg.model.tiny_family = args.family
    positions = getattr(args, "max_positions", MAX_POSITIONS)
    out = args.out or default_tiny_dir(cfg)
    if args.out is None and positions != MAX_POSITIONS:
        out = out.with_name(f"{out.name}-ctx{positions}")
    head_dim = getattr(args, "head_dim", HEAD_DIM)
    if args.out is None and head_dim != HEAD_DIM:
        out = out.with_name(f"{out.name}-hd{head_dim}")
    try:
        path = ensure_tiny_model(out, cfg.model.tiny_family, positions, head_dim)
    except ValueError as e:  # a directory holding another family: nothing was overwritten
        print(f"gyre make-model: {e}", file=sys.stderr)
        return 2
    ident = model_identity(path)
    print(f"{path}  model_hash={ident['model_hash'][:16]}  tokenizer_hash={ident['tokenizer_hash'][:16]}")
    return 0
