"""Megatron MoE trainers that save and load checkpoints at expert parallel 2 (spawned gloo ranks)
and in one process: for tests/train/test_checkpoint_megatron.py and benchmarks/bench_checkpoints.py."""

from __future__ import annotations

import torch

from gyre.config import TrainConfig
from support.megatron_moe import _batch, _CFG


def _ep2_rank(ckpt, load, rank, port, hf_config, hf_state, out):
    """One expert-parallel rank: (load ``ckpt`` and) take a step on half the batch; with
    ``load`` False it saves ``ckpt`` after a first step, then takes the second."""
    from gyre.train.dist import init_distributed
    from gyre.train.megatron_trainer import MegatronTrainer

    torch.set_num_threads(1)
    init_distributed(rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    trainer = MegatronTrainer(TrainConfig(expert_parallel=2, **_CFG), hf_config,
                              {k: torch.from_numpy(v) for k, v in hf_state.items()})
    if load:
        trainer.load_checkpoint(ckpt)
    else:
        trainer.forward_backward(_batch([2 * rank, 2 * rank + 1], 4))
        trainer.optimizer_step()
        trainer.save_checkpoint(ckpt)  # every rank takes part
    trainer.forward_backward(_batch([2 * rank, 2 * rank + 1], 4))
    trainer.optimizer_step()
    full = trainer.hf_state_dict()  # collective
    if rank == 0:
        out.put((trainer.step, {k: v.numpy().copy() for k, v in full.items()}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def one_process(hf, hf_state, ckpt=None, save=None):
    from gyre.train.megatron_trainer import MegatronTrainer

    t = MegatronTrainer(TrainConfig(**_CFG), hf.config, {k: torch.from_numpy(v) for k, v in hf_state.items()})
    if ckpt is not None:
        t.load_checkpoint(ckpt)
    if save is not None:
        t.forward_backward(_batch([0, 1, 2, 3], 4))
        t.optimizer_step()
        t.save_checkpoint(save)
    t.forward_backward(_batch([0, 1, 2, 3], 4))
    t.optimizer_step()
    return t.step, t.hf_state_dict()
