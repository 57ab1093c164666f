"""A model directory's identity, recorded by everything that uses a model (shards, exports,
the engine's ``/model_info``).

``model_hash`` is the sha256 over the model's tensors sorted by name; for each tensor it hashes
``name``, its safetensors dtype (``F32``...), its shape and its raw little-endian bytes (see
:func:`tensors_hash`), so it does not depend on file layout or sharding. ``tokenizer_hash`` is
the sha256 of ``tokenizer.json``. Stored as ``gyre_identity.json`` next to the weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

from gyre.fsio import atomic_write_text  # a leaf: the one atomic writer

IDENTITY_FILE = "gyre_identity.json"


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
    path = Path(model_dir) / IDENTITY_FILE
    atomic_write_text(path, json.dumps(ident, indent=1, sort_keys=True) + "\n", mode=0o644)
    return ident


def model_identity(model_dir: str | os.PathLike, recompute: bool = False) -> dict:
    """The directory's identity: ``gyre_identity.json`` if present, else computed from the files."""
    path = Path(model_dir) / IDENTITY_FILE
    stored = json.loads(path.read_text(encoding="utf-8")) if path.exists() else None
    if stored and not recompute:
        return stored
    return compute_identity(model_dir, name=(stored or {}).get("name"))
