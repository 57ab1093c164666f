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

from gyre.fsio import atomic_dir, fsync_path, replace_dir
from gyre.model.checksums import write_checksums  # the manifest the engine verifies on load

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


# --- a model directory a researcher keeps: weights plus everything a loader needs -------------------

# files of a transformers model directory besides the weights, copied from the run's model
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja",
                   "chat_template.json")
CHATML_TEMPLATE = Path(__file__).resolve().parents[1] / "assets" / "chatml.jinja"


def _token_text(tokenizer_json: Path, token_id) -> str | None:
    """The text of an added/special token id in tokenizer.json (None when absent or not given)."""
    if isinstance(token_id, list):
        token_id = token_id[0] if token_id else None
    if token_id is None or not tokenizer_json.exists():
        return None
    added = json.loads(tokenizer_json.read_text(encoding="utf-8")).get("added_tokens", [])
    return next((t["content"] for t in added if t.get("id") == token_id), None)


def _complete_loader_files(tmp: Path, cfg: dict) -> None:
    """What the source lacked: ``tokenizer_config.json`` (its special tokens from config.json's
    ids), ``generation_config.json`` (the same ids) and a chat template (Gyre's built-in ChatML,
    what the proxy rendered with when the model had none)."""
    text = lambda key: _token_text(tmp / "tokenizer.json", cfg.get(key))  # noqa: E731
    if not (tmp / "tokenizer_config.json").exists() and (tmp / "tokenizer.json").exists():
        tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.get("max_position_embeddings"),
                   "clean_up_tokenization_spaces": False}
        tok_cfg |= {name: text(f"{name}_id") for name in ("bos_token", "eos_token", "pad_token") if text(f"{name}_id")}
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    if not (tmp / "generation_config.json").exists():
        gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
    tok_cfg_file = tmp / "tokenizer_config.json"
    in_tok_cfg = tok_cfg_file.exists() and "chat_template" in json.loads(tok_cfg_file.read_text(encoding="utf-8"))
    if not ((tmp / "chat_template.jinja").exists() or in_tok_cfg):
        shutil.copyfile(CHATML_TEMPLATE, tmp / "chat_template.jinja")


EXPORT_FILE = "gyre_export.json"  # where an export came from: run, step, that step's checkpoint


def write_model_dir(out_dir: str | os.PathLike, state: dict[str, Tensor], hf_config, source_dir: str | os.PathLike,
                    weight_version: int | str, source: dict | None = None) -> Path:
    """A complete transformers directory, written atomically: the weights (safetensors) and
    config, the source model's tokenizer, chat template and generation config (each written from
    the config when the source had none), and the weights manifest. What `gyre export` writes;
    `AutoModelForCausalLM.from_pretrained` and `gyre engine --model` load it."""
    from safetensors.torch import save_file

    src = Path(source_dir)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    with atomic_dir(out_dir) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt", "weight_version": str(weight_version)})
        _write_config(tmp, hf_config, {v.dtype for v in tensors.values()}, weight_version)
        for name in TOKENIZER_FILES:
            if (src / name).exists():
                shutil.copyfile(src / name, tmp / name)
        _complete_loader_files(tmp, json.loads((tmp / "config.json").read_text()))
        if source is not None:
            (tmp / EXPORT_FILE).write_text(json.dumps(source, indent=1))
        write_checksums(tmp)
    return Path(out_dir)


def carried_checkpoint(export_dir: str | os.PathLike) -> str:
    """The trainer checkpoint of the step ``export_dir`` was exported from (model.init_optimizer =
    "carried"); a clear error when the export does not name one or it is gone."""
    f = Path(export_dir) / EXPORT_FILE
    ckpt = json.loads(f.read_text()).get("checkpoint") if f.exists() else None
    if not ckpt:
        raise FileNotFoundError(f"{export_dir} names no trainer checkpoint ({EXPORT_FILE}): the optimizer cannot be "
                                f"carried; set model.init_optimizer = \"fresh\" or export a step whose checkpoint is kept")
    if not Path(ckpt).is_dir():
        raise FileNotFoundError(f"the checkpoint {ckpt} that {export_dir} was exported from is gone; set "
                                f"model.init_optimizer = \"fresh\"")
    return ckpt
