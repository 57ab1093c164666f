"""Two data-parallel Megatron ranks under gloo give the step of one process on the whole batch."""

import torch

from gyre.config import TrainConfig
from gyre.batch import expanded_batch
from gyre.train.toy import random_qwen2
from support.gloo_ranks import spawned_ranks

SEQS = [[1, 2, 3, 40, 41, 42, 43], [1, 2, 3, 50, 51], [9, 8, 60, 61, 62, 63, 64, 65], [9, 8, 70]]
PLENS = [3, 3, 2, 2]
ADV = [1.0, -1.0, 0.5, -0.5]
# a large Adam eps makes the first update ~ lr * grad instead of lr * sign(grad), so rounding-level
# gradient differences stay rounding-level in the parameters
_CFG = TrainConfig(lr=1e-3, dtype="float32", adam_eps=1.0)


def _batch(rows, num_executions):
    from gyre.batch import per_execution_weights

    seqs = [SEQS[r] for r in rows]
    old = [[-4.0] * (len(SEQS[r]) - PLENS[r]) for r in rows]
    exe = torch.tensor([r for r in rows for _ in range(len(SEQS[r]) - PLENS[r])])
    # weights for the whole step: divide by the step's executions, not the rank's
    w = per_execution_weights(exe, num_executions)
    return expanded_batch(seqs, [PLENS[r] for r in rows], old_logprobs=old,
                          advantages=[ADV[r] for r in rows], execution_index=list(rows), weights=w)


def _rank(rank, port, hf_config, hf_state, out):
    from gyre.train.dist import init_distributed
    from gyre.train.megatron_trainer import MegatronTrainer

    torch.set_num_threads(1)
    init_distributed(rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    state = {k: torch.from_numpy(v) for k, v in hf_state.items()}
    trainer = MegatronTrainer(_CFG, hf_config, state)
    trainer.forward_backward(_batch([2 * rank, 2 * rank + 1], 4))
    stats = trainer.optimizer_step()
    if rank == 0:
        # numpy arrays travel by value; torch tensors would go through shared memory that
        # disappears with this process
        out.put((stats["grad_norm"], {k: v.numpy().copy() for k, v in trainer.hf_state_dict().items()}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def test_two_gloo_ranks_sum_to_the_whole_step():
    from gyre.train.trainer import EmbeddedTrainer

    hf = random_qwen2(seed=0, std=0.1)
    hf_state = {k: v.numpy().copy() for k, v in hf.state_dict().items()}
    [(grad_norm, dist_params)] = spawned_ranks(_rank, hf.config, hf_state, replies=1, timeout_s=120)

    ref = EmbeddedTrainer(_CFG, hf)
    ref.forward_backward(_batch([0, 1, 2, 3], 4))
    stats = ref.optimizer_step()
    assert abs(stats["grad_norm"] - grad_norm) < 1e-4 * grad_norm
    for k, v in ref.hf_state_dict().items():
        assert torch.allclose(v, torch.from_numpy(dist_params[k]), atol=1e-7), k
    assert not torch.allclose(ref.hf_state_dict()["lm_head.weight"], torch.from_numpy(hf_state["lm_head.weight"]))
