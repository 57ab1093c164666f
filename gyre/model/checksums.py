"""Checksums of exported weights, and the checks an engine runs before serving new weights.

Manifest: ``weights.sha256.json`` next to the ``*.safetensors`` files, covering every file an
engine reads from the directory (the weights and every ``*.json``: config, tokenizer, index),
so an edited ``rms_norm_eps`` or ``hidden_act`` is caught as a flipped weight bit is::

    {"format": "gyre-weights-sha256/1", "files": {"model.safetensors": "<sha256 hex>", "config.json": ...}}

:func:`write_checksums` is what an exporter calls after writing the files (atomically, last, so
a manifest never describes files still being written); :func:`verify_checksums` is what the engine
calls before loading new weights: a directory without a manifest is refused unless the caller
says it is trusted (the checkpoint an engine was started from, a plain Hugging Face directory);
every load still refuses non-finite tensors (:func:`check_finite`).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

from gyre.fsio import atomic_write_json

MANIFEST = "weights.sha256.json"
FORMAT = "gyre-weights-sha256/1"
_CHUNK = 8 << 20


class WeightCheckError(ValueError):
    """The weights on disk are not the ones that were exported, or are not usable."""


def require_regular_files(model_dir: str | Path) -> None:
    """Refuse a checkpoint whose weights, config or manifest is not a regular file (after
    symlinks): opening a FIFO blocks until a writer comes, which froze the whole engine."""
    d = Path(model_dir)
    for f in sorted(d.glob("*.safetensors")) + [d / "config.json", d / MANIFEST]:
        try:
            mode = os.stat(f).st_mode
        except FileNotFoundError:
            continue  # a missing file is the loader's error, with its own message
        except OSError as e:
            raise WeightCheckError(f"{f}: cannot stat ({e})") from None
        if not stat.S_ISREG(mode):
            raise WeightCheckError(f"{f} is not a regular file (a FIFO, device or directory); weights "
                                   "are read only from regular files")


def sha256_file(path: Path) -> str:
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise WeightCheckError(f"{path} is not a regular file")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def covered_files(model_dir: str | Path) -> list[Path]:
    """What a manifest covers: the weights and every JSON file (config, tokenizer, index)."""
    d = Path(model_dir)
    return sorted(f for f in [*d.glob("*.safetensors"), *d.glob("*.json")] if f.name != MANIFEST)


def write_checksums(model_dir: str | Path) -> Path:
    """Write the manifest for every file :func:`covered_files` names; returns its path."""
    d = Path(model_dir)
    if not any(d.glob("*.safetensors")):
        raise WeightCheckError(f"{d}: no *.safetensors file to checksum")
    manifest = {"format": FORMAT, "files": {f.name: sha256_file(f) for f in covered_files(d)}}
    atomic_write_json(d / MANIFEST, manifest)
    return d / MANIFEST


def verify_checksums(model_dir: str | Path, required: bool = True) -> bool:
    """Check the files against the manifest; raise on a mismatch, or on no manifest when
    ``required``; False when there is none and it is not."""
    d = Path(model_dir)
    path = d / MANIFEST
    if not path.exists():
        if required and d.is_dir():  # (a missing directory is the loader's error, with its own message)
            raise WeightCheckError(f"{d} has no {MANIFEST}: weights are loaded only as exported, with their "
                                   "checksums (gyre.model.checksums.write_checksums writes them for a "
                                   "directory you trust)")
        return False
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        files = manifest["files"]
        if manifest.get("format") != FORMAT or not isinstance(files, dict):
            raise ValueError(f"format is {manifest.get('format')!r}, expected {FORMAT!r}")
    except (ValueError, KeyError, TypeError) as e:
        raise WeightCheckError(f"{path}: unreadable checksum manifest ({e})") from None
    on_disk = {f.name for f in covered_files(d)}
    unlisted = sorted(on_disk - set(files))
    if unlisted:
        raise WeightCheckError(f"{d}: {unlisted} not in {MANIFEST} (files added after the export?)")
    for name, want in sorted(files.items()):
        f = d / name
        if not f.is_file():
            raise WeightCheckError(f"{d}: {name} is listed in {MANIFEST} but missing")
        got = sha256_file(f)
        if got != want:
            raise WeightCheckError(f"{f}: sha256 {got[:16]}... does not match the exported {want[:16]}... "
                                   "(the file was changed or corrupted after export)")
    return True


def check_finite(tensors: dict) -> None:
    """Refuse NaN/Inf anywhere: such weights answer with garbage or nothing at all."""
    import torch

    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise WeightCheckError(f"tensor {name} has {bad} non-finite value(s) (NaN or Inf)")
