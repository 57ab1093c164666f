"""Megatron trainers of the tiny qwen2 at tensor parallel 2 and pipeline parallel 2 (two spawned gloo
ranks) and in one process, saving and loading layout-free checkpoints: for
tests/train/test_megatron_layouts.py and benchmarks/bench_checkpoints.py."""

from __future__ import annotations

from pathlib import Path

import torch

from gyre.batch import expanded_batch, per_execution_weights
from gyre.config import TrainConfig

SEQS = [[1, 2, 3, 40, 41, 42, 43], [1, 2, 3, 50, 51], [9, 8, 60, 61, 62, 63, 64, 65], [9, 8, 70]]
PLENS = [3, 3, 2, 2]
ADV = [1.0, -1.0, 0.5, -0.5]
# a large Adam eps makes the first update ~ lr * grad instead of lr * sign(grad), so rounding-level
# gradient differences stay rounding-level in the parameters
CFG = dict(lr=1e-3, dtype="float32", adam_eps=1.0)


def batch():
    rows = range(len(SEQS))
    old = [[-4.0] * (len(SEQS[r]) - PLENS[r]) for r in rows]
    exe = torch.tensor([r for r in rows for _ in range(len(SEQS[r]) - PLENS[r])])
    return expanded_batch([SEQS[r] for r in rows], [PLENS[r] for r in rows], old_logprobs=old,
                          advantages=[ADV[r] for r in rows], execution_index=list(rows),
                          weights=per_execution_weights(exe, len(SEQS)))


def model(tied: bool = False):
    from gyre.train.toy import random_qwen2, tiny_qwen2_config

    hf = random_qwen2(tiny_qwen2_config(tie_word_embeddings=tied), seed=0, std=0.1)
    return hf, {k: v.numpy().copy() for k, v in hf.state_dict().items()}


def trainer(hf_config, hf_state: dict, **layout):
    from gyre.train.megatron_trainer import MegatronTrainer

    return MegatronTrainer(TrainConfig(**CFG, **layout), hf_config,
                           {k: torch.from_numpy(v) for k, v in hf_state.items()})


def numpy_state(state: dict) -> dict:
    """numpy arrays travel by value between processes; tensors go through shared memory that
    disappears with the process that made them."""
    return {k: (v.numpy().copy() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def saved(path: Path) -> dict:
    """The layout-free state a checkpoint directory holds (model and Adam moments, HF names)."""
    from gyre.train.base import CHECKPOINT_FILE

    return torch.load(Path(path) / CHECKPOINT_FILE, map_location="cpu", weights_only=False)["state"]


def layout_rank(layout: dict, load: Path | None, save: Path | None, step: bool,
                rank, port, hf_config, hf_state, out):
    """One of two gloo ranks at ``layout`` (e.g. ``{"tensor_parallel": 2}``): load ``load``, take
    a step on the whole batch when ``step``, save ``save``; rank 0 replies (step, the whole model
    in HF names, this rank's log-probs of the batch or None on a stage without the output layer)."""
    from gyre.train.dist import init_distributed

    torch.set_num_threads(1)
    init_distributed(rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    t = trainer(hf_config, hf_state, **layout)
    if load is not None:
        t.load_checkpoint(load)
    if step:
        stats = t.forward_backward(batch())
        stats |= t.optimizer_step()
    if save is not None:
        t.save_checkpoint(save)  # every rank takes part
    whole = t.hf_state_dict()  # collective
    logp = t.logprobs(batch()).numpy().copy() if layout.get("pipeline_parallel", 1) == 1 else None
    if rank == 0:
        out.put((t.step, numpy_state(whole), logp, stats if step else None))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
