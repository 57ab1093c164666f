"""The transformers/SGLang weight layout the engines load, written as whole directories.

A reader (an engine loading new weights, a resumed job) sees either the old directory or the
complete new one: everything is written into a temporary sibling, fsynced, and renamed into place
(gyre.fsio.atomic_dir / replace_dir).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch
from torch import Tensor

from gyre.engine.checksums import write_checksums  # the manifest the engine verifies on load
from gyre.fsio import atomic_dir, fsync_path, replace_dir

WEIGHTS_FILE = "model.safetensors"
VERSION_FILE = "gyre_weights.json"


def write_hf_weights(out_dir: str | os.PathLike, state: dict[str, Tensor], hf_config,
                     weight_version: int | str) -> Path:
    """Write `config.json` + `model.safetensors` (+ the version) atomically; returns out_dir."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    dtypes = {v.dtype for v in tensors.values()}
    with atomic_dir(out_dir) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt",
                                                              "weight_version": str(weight_version)})
        _write_config(tmp, hf_config, dtypes, weight_version)
        write_checksums(tmp)
    return Path(out_dir)


def config_dict(hf_config) -> dict:
    """config.json's content from a dict (the embedded trainer keeps the file as read) or a
    transformers config object (the Megatron backend)."""
    return dict(hf_config) if isinstance(hf_config, dict) else hf_config.to_dict()


def _write_config(tmp: Path, hf_config, dtypes: set, weight_version: int | str) -> None:
    """config.json (its dtype that of the weights, when they share one) and the version file."""
    cfg = config_dict(hf_config)
    if len(dtypes) == 1:
        cfg["torch_dtype"] = cfg["dtype"] = str(next(iter(dtypes))).removeprefix("torch.")
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    (tmp / VERSION_FILE).write_text(json.dumps({"weight_version": str(weight_version)}))


def load_hf_dir(path: str | os.PathLike) -> tuple[object, dict[str, Tensor]]:
    """(config, state dict) of a transformers model directory with safetensors weights."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    state: dict[str, Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return AutoConfig.from_pretrained(str(path)), state


def save_torch_atomic(path_dir: str | os.PathLike, payload: dict, *, filename: str = "state.pt") -> Path:
    """torch.save `payload` as `path_dir/filename`, the directory replaced atomically."""
    with atomic_dir(path_dir) as tmp:
        torch.save(payload, tmp / filename)
    return Path(path_dir)


# --- parallel export: every rank of the leader cell writes one piece ---------------------------------

INDEX_FILE = "model.safetensors.index.json"


def assign_pieces(state: dict[str, Tensor], parts: int) -> list[list[str]]:
    """Tensor names per piece, balanced by bytes (largest first onto the lightest piece); the
    same on every rank because it depends only on names and shapes."""
    pieces: list[list[str]] = [[] for _ in range(parts)]
    load = [0] * parts
    for name in sorted(state, key=lambda k: (-state[k].numel() * state[k].element_size(), k)):
        i = min(range(parts), key=lambda j: (load[j], j))
        pieces[i].append(name)
        load[i] += state[name].numel() * state[name].element_size()
    return [sorted(p) for p in pieces]


def piece_name(rank: int, size: int) -> str:
    return WEIGHTS_FILE if size == 1 else f"model-{rank + 1:05d}-of-{size:05d}.safetensors"


def export_pieces(state: dict[str, Tensor], hf_config, out_dir: str | os.PathLike, weight_version: int | str,
                  *, rank: int = 0, size: int = 1, barrier=lambda: None, broadcast=lambda x: x) -> Path:
    """Write the weights as ``size`` safetensors pieces in parallel (rank r writes piece r) plus
    the transformers index, into one temporary directory renamed into place by rank 0 when every
    piece is on disk. Engines load the result with ``/update_weights_from_disk``. Every rank calls
    this with the same state; ``barrier``/``broadcast`` are the cell's collectives."""
    from safetensors.torch import save_file

    final = Path(out_dir)
    tmp_name = broadcast(f".{final.name}.tmp-{uuid.uuid4().hex[:8]}" if rank == 0 else None)
    tmp = final.parent / tmp_name
    if rank == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir(mode=0o700)
    barrier()
    try:
        names = assign_pieces(state, size)
        mine = {k: state[k].detach().to("cpu").contiguous() for k in names[rank]}
        path = tmp / piece_name(rank, size)
        save_file(mine, str(path), metadata={"format": "pt", "weight_version": str(weight_version)})
        fsync_path(path)
        barrier()
        if rank == 0:
            _write_config(tmp, hf_config, {v.dtype for v in state.values()}, weight_version)
            if size > 1:
                total = sum(v.numel() * v.element_size() for v in state.values())
                index = {"metadata": {"total_size": total},
                         "weight_map": {k: piece_name(r, size) for r, ks in enumerate(names) for k in ks}}
                (tmp / INDEX_FILE).write_text(json.dumps(index, indent=1, sort_keys=True))
            write_checksums(tmp)
            replace_dir(tmp, final)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    barrier()
    return final
