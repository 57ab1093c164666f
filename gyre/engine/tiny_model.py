"""The embedded tiny model: a random transformers model (``Qwen2ForCausalLM`` by default, or any
family of `gyre.model`, e.g. ``Qwen3MoeForCausalLM``) built offline in seconds.

``gyre make-model [--family F] [--out DIR]`` (or :func:`ensure_tiny_model`) writes, atomically
(temporary directory + rename), a transformers model directory with transformers' own
``save_pretrained``: ``config.json``, ``model.safetensors``, ``tokenizer.json`` (the committed
``gyre/assets/tokenizer.json``) and ``gyre_identity.json``.

Identity (recorded by everything that uses a model): ``model_hash`` is the sha256 over the
model's tensors sorted by name; for each tensor it hashes ``name``, its safetensors dtype
(``F32``...), its shape and its raw little-endian bytes (see :func:`tensors_hash`), so it does
not depend on file layout or sharding. ``tokenizer_hash`` is the sha256 of ``tokenizer.json``.

The weights are drawn from N(0, 0.15) (biases and norm gains too, around 0 and 1) with a fixed
seed: a non-tiny std keeps attention far from uniform, so a wrong RoPE, mask or weight layout
changes logits visibly in tests.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path

from tokenizers import Tokenizer

from gyre.engine.build_tokenizer import ADDED_TOKENS, ASSET as TOKENIZER_ASSET, SPECIAL_TOKENS
from gyre.fsio import atomic_write_text

NAME = "gyre-tiny-qwen"
IDENTITY_FILE = "gyre_identity.json"
SEED = 20251129
INIT_STD = 0.15
# Enough to build config.json; vocab_size is added from the tokenizer.
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6)
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
CONFIG_CLASS = {"qwen2": "Qwen2Config", "llama": "LlamaConfig", "qwen3": "Qwen3Config",
                "qwen3_moe": "Qwen3MoeConfig", "qwen2_moe": "Qwen2MoeConfig"}


def tiny_name(family: str) -> str:
    return NAME if family == "qwen2" else f"gyre-tiny-{family.replace('_', '-')}"


def load_tokenizer(model_dir: str | os.PathLike) -> Tokenizer:
    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))


def special_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """Token text -> id for the ChatML special tokens and the added tool/think tokens present."""
    out = {}
    for text in SPECIAL_TOKENS + ADDED_TOKENS:
        tid = tokenizer.token_to_id(text)
        if tid is not None:
            out[text] = tid
    return out


def _safetensors_index(path: Path) -> tuple[int, dict]:
    """(data start offset, header) of one .safetensors file, read without loading tensors."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


def tensors_hash(model_dir: str | os.PathLike) -> str:
    """sha256 over all tensors of the directory's ``*.safetensors`` files, sorted by name."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors file")
    entries = []
    for path in files:
        start, header = _safetensors_index(path)
        entries += [(name, path, start, info) for name, info in header.items()]
    h = hashlib.sha256()
    for name, path, start, info in sorted(entries, key=lambda e: e[0]):
        h.update(f"{name}\0{info['dtype']}\0{info['shape']}\0".encode())
        begin, end = info["data_offsets"]
        with open(path, "rb") as f:
            f.seek(start + begin)
            remaining = end - begin
            while remaining:
                chunk = f.read(min(remaining, 1 << 24))
                h.update(chunk)
                remaining -= len(chunk)
    return h.hexdigest()


def compute_identity(model_dir: str | os.PathLike, name: str | None = None) -> dict:
    model_dir = Path(model_dir)
    tok = model_dir / "tokenizer.json"
    return {
        "model_hash": tensors_hash(model_dir),
        "tokenizer_hash": hashlib.sha256(tok.read_bytes()).hexdigest() if tok.exists() else None,
        "name": name or model_dir.name,
    }


def write_identity(model_dir: str | os.PathLike, name: str | None = None) -> dict:
    """Compute and store ``gyre_identity.json`` (weight exporters call this after writing)."""
    ident = compute_identity(model_dir, name)
    atomic_write_text(Path(model_dir) / IDENTITY_FILE, json.dumps(ident, indent=1, sort_keys=True) + "\n", mode=0o644)
    return ident


def model_identity(model_dir: str | os.PathLike, recompute: bool = False) -> dict:
    """The directory's identity: ``gyre_identity.json`` if present, else computed from the files."""
    path = Path(model_dir) / IDENTITY_FILE
    stored = json.loads(path.read_text(encoding="utf-8")) if path.exists() else None
    if stored and not recompute:
        return stored
    return compute_identity(model_dir, name=(stored or {}).get("name"))


def _build(dst: Path, family: str = "qwen2") -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    tok = Tokenizer.from_file(str(TOKENIZER_ASSET))
    ids = special_ids(tok)
    vocab = -(-tok.get_vocab_size() // 64) * 64
    extra = {} if family == "llama" else {"use_sliding_window": False}
    config = getattr(transformers, CONFIG_CLASS[family])(
        vocab_size=vocab, tie_word_embeddings=False, hidden_act="silu", initializer_range=INIT_STD,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
        **TINY_SHAPE, **FAMILY_SHAPE[family], **extra,
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
    write_identity(dst, tiny_name(family))


def ensure_tiny_model(out_dir: str | os.PathLike, family: str = "qwen2") -> Path:
    """Build the tiny model of `family` in ``out_dir`` unless a complete one is there; return its
    path (a complete directory of another family is refused, not overwritten)."""
    if family not in FAMILY_SHAPE:
        raise ValueError(f"family {family!r}: choose one of {', '.join(FAMILY_SHAPE)}")
    out_dir = Path(out_dir)
    if (out_dir / IDENTITY_FILE).exists():
        found = json.loads((out_dir / "config.json").read_text(encoding="utf-8")).get("model_type")
        if found != family:
            raise ValueError(f"{out_dir} holds a {found} model, not {family}; pass another --out "
                             f"(or model.tiny_dir) for the {family} model")
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        _build(tmp, family)
        try:  # not fsio.atomic_dir: the first builder wins here (a cache, rebuilt if lost)
            tmp.rename(out_dir)
        except OSError:
            # Another process finished first (rename onto a non-empty dir fails): keep theirs.
            if not (out_dir / IDENTITY_FILE).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def add_arguments(parser) -> None:
    parser.add_argument("--out", type=Path, default=None,
                        help="model directory (default: model.tiny_dir, or ~/.cache/gyre/tiny-qwen)")
    parser.add_argument("--config", default=None, help="Gyre TOML config file")
    parser.add_argument("--family", default=None, choices=sorted(FAMILY_SHAPE),
                        help="model family (default: model.tiny_family, qwen2)")


def run(args) -> int:
    from gyre.config import default_tiny_dir, load_config

    cfg = load_config(getattr(args, "config", None))
    if getattr(args, "family", None):
        cfg.model.tiny_family = args.family
    out = args.out or default_tiny_dir(cfg)
    try:
        path = ensure_tiny_model(out, cfg.model.tiny_family)
    except ValueError as e:  # a directory holding another family: nothing was overwritten
        print(f"gyre make-model: {e}", file=sys.stderr)
        return 2
    ident = model_identity(path)
    print(f"{path}  model_hash={ident['model_hash'][:16]}  tokenizer_hash={ident['tokenizer_hash'][:16]}")
    return 0
