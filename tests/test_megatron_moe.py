"""Megatron-Core MoE (Qwen3-MoE family) with expert parallelism 2 over gloo: two ranks, each
holding half the experts and half the batch, give the step of one process on the whole batch
(grad norm, every updated weight, gathered back to checkpoint names), aux loss included."""

import socket

import pytest
import torch
import torch.multiprocessing as mp

from gyre.batch import expanded_batch, per_execution_weights
from gyre.config import TrainConfig

# equal lengths: on the CPU the experts' token dispatcher is "allgather", which needs every
# expert-parallel rank's micro-batch to hold the same number of tokens (CUDA's alltoall does not)
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


@pytest.mark.slow
def test_expert_parallel_two_ranks_equal_one_process():
    from gyre.model.spec import split_fused_experts
    from gyre.train.trainer import EmbeddedTrainer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    hf = _model()
    hf_state = {k: v.numpy().copy() for k, v in split_fused_experts(hf.state_dict()).items()}
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, hf.config, hf_state, out)) for r in range(2)]
    for p in procs:
        p.start()
    grad_norm, aux, local_experts, ep_size, dist_params = out.get(timeout=180)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert (ep_size, local_experts) == (2, 4 // 2 * 2)  # 2 layers x 2 of the 4 experts on each rank

    ref = EmbeddedTrainer(TrainConfig(**_CFG), hf)
    ref.forward_backward(_batch([0, 1, 2, 3], 4))
    stats = ref.optimizer_step()
    assert stats["moe_aux_loss"] > 0 and aux is None  # logged by the embedded trainer; Megatron: only when on
    assert abs(stats["grad_norm"] - grad_norm) < 1e-4 * grad_norm, (stats["grad_norm"], grad_norm)
    want = ref.hf_state_dict()
    assert set(want) == set(dist_params)
    for k, v in want.items():
        assert torch.allclose(v, torch.from_numpy(dist_params[k]), atol=1e-7), k
    # the step moved the experts (so the comparison can fail)
    k = "model.layers.0.mlp.experts.3.up_proj.weight"
    assert not torch.allclose(want[k], torch.from_numpy(hf_state[k]))


def test_aux_loss_is_the_same_term_in_both_trainers():
    """One process: Megatron's load-balancing loss (its router, MoEAuxLossAutoScaler) and the
    embedded trainer's have the same value and move the weights the same way."""
    from gyre.model.spec import split_fused_experts
    from gyre.train.megatron_trainer import MegatronTrainer
    from gyre.train.trainer import EmbeddedTrainer

    hf = _model()
    state = split_fused_experts({k: v.detach().clone() for k, v in hf.state_dict().items()})
    results = []
    for coef in (0.0, 0.5):
        cfg = TrainConfig(moe_aux_loss_coef=coef, **_CFG)
        mg, emb = MegatronTrainer(cfg, hf.config, state), EmbeddedTrainer(cfg, hf)
        for t in (mg, emb):
            t.forward_backward(_batch([0, 1, 2, 3], 4))
        s_mg, s_emb = mg.optimizer_step(), emb.optimizer_step()
        assert abs(s_mg["grad_norm"] - s_emb["grad_norm"]) < 1e-4 * s_emb["grad_norm"]
        if coef:
            assert abs(s_mg["moe_aux_loss"] - s_emb["moe_aux_loss"]) < 1e-5, (s_mg, s_emb)
        a, b = mg.hf_state_dict(), emb.hf_state_dict()
        for k in b:
            assert torch.allclose(a[k], b[k], atol=1e-7), (coef, k)
        results.append(s_emb["grad_norm"])
    assert results[0] != pytest.approx(results[1], rel=1e-3)  # the aux term does change the step
