"""Trainer backends by name: `train.backend` in the configuration picks a factory here.

Each factory imports its backend only when chosen (Megatron-Core is heavy and optional), so the
backends never import each other and adding one is one entry in `BACKENDS`.
"""

from __future__ import annotations

import os
from typing import Callable

from gyre.config import TrainBackend, TrainConfig
from gyre.train.base import Trainer


def _embedded(cfg: TrainConfig, model_dir: str | os.PathLike, seed: int) -> Trainer:
    from gyre.train.trainer import EmbeddedTrainer  # torch: the backend asked for loads, the other never

    return EmbeddedTrainer(cfg, model_dir)


def _megatron(cfg: TrainConfig, model_dir: str | os.PathLike, seed: int) -> Trainer:
    from gyre.train.export import load_hf_dir  # as above
    from gyre.train.megatron_trainer import MegatronTrainer  # Megatron-Core: only for this backend

    return MegatronTrainer(cfg, *load_hf_dir(model_dir), seed=seed)


BACKENDS: dict[TrainBackend, Callable[[TrainConfig, str | os.PathLike, int], Trainer]] = {
    TrainBackend.EMBEDDED: _embedded,
    TrainBackend.MEGATRON: _megatron,
}


def make_trainer(cfg: TrainConfig, model_dir: str | os.PathLike, *, seed: int = 0) -> Trainer:
    """The configured backend, initialised from a transformers model directory."""
    factory = BACKENDS.get(cfg.backend)
    if factory is None:
        raise ValueError(f"train.backend={cfg.backend!r}: choose one of {', '.join(BACKENDS)}")
    return factory(cfg, model_dir, seed)
