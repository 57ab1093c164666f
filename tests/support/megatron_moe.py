"""A tiny Megatron MoE, its batch and one expert-parallel rank, for the MoE tests and benchmarks/bench_moe.py."""

from __future__ import annotations

import torch

from gyre.batch import expanded_batch, per_execution_weights
from gyre.config import TrainConfig
from support.gloo_ranks import spawned_ranks


SEQS = [[1, 2, 3, 40, 41, 42, 43, 44], [1, 2, 3, 50, 51, 52, 53, 54], [9, 8, 60, 61, 62, 63, 64, 65],
        [9, 8, 70, 71, 72, 73, 74, 75]]
PLENS = [3, 3, 2, 2]
ADV = [1.0, -1.0, 0.5, -0.5]
_CFG = dict(lr=1e-3, dtype="float32", adam_eps=1.0)


def _batch(rows, num_executions):
    old = [[-4.0] * (len(SEQS[r]) - PLENS[r]) for r in rows]
    exe = torch.tensor([r for r in rows for _ in range(len(SEQS[r]) - PLENS[r])])
    return expanded_batch([SEQS[r] for r in rows], [PLENS[r] for r in rows], old_logprobs=old,
                          advantages=[ADV[r] for r in rows], execution_index=list(rows),
                          weights=per_execution_weights(exe, num_executions))


def _model():
    from gyre.train.toy import random_model, tiny_config

    return random_model(tiny_config("qwen3_moe", experts=4, top_k=2), seed=0, std=0.1)


def two_expert_parallel_ranks(hf, hf_state: dict) -> tuple:
    """One step of Megatron MoE at expert parallelism 2 over gloo, two spawned processes each with
    half the batch: (grad norm, aux loss, local expert weights on rank 0, EP size, every updated
    weight in checkpoint names). ``hf_state``: the checkpoint-named weights as numpy arrays."""
    return spawned_ranks(_rank, hf.config, hf_state, replies=1)[0]


def _rank(rank, port, hf_config, hf_state, out):
    from gyre.train.dist import init_distributed
    from gyre.train.megatron_trainer import MegatronTrainer

    torch.set_num_threads(1)
    init_distributed(rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    state = {k: torch.from_numpy(v) for k, v in hf_state.items()}
    trainer = MegatronTrainer(TrainConfig(expert_parallel=2, **_CFG), hf_config, state)
    from megatron.core import parallel_state

    local = sum(1 for k in trainer.model.state_dict() if "local_experts" in k and k.endswith("fc1.weight"))
    trainer.forward_backward(_batch([2 * rank, 2 * rank + 1], 4))
    stats = trainer.optimizer_step()
    full = trainer.hf_state_dict()
    if rank == 0:
        out.put((stats["grad_norm"], stats.get("moe_aux_loss"), local,
                 parallel_state.get_expert_model_parallel_world_size(),
                 {k: v.numpy().copy() for k, v in full.items()}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
