"""Megatron-Core MoE (Qwen3-MoE family) with expert parallelism 2 over gloo: two ranks, each
holding half the experts and half the batch, give the step of one process on the whole batch
(grad norm, every updated weight, gathered back to checkpoint names), aux loss included."""

import pytest
import torch

from gyre.config import TrainConfig
from support.megatron_moe import _batch, _CFG, _model, two_expert_parallel_ranks

# equal lengths: on the CPU the experts' token dispatcher is "allgather", which needs every
# expert-parallel rank's micro-batch to hold the same number of tokens (CUDA's alltoall does not)


@pytest.mark.slow
def test_expert_parallel_two_ranks_equal_one_process():
    from gyre.model.spec import split_fused_experts
    from gyre.train.trainer import EmbeddedTrainer

    hf = _model()
    hf_state = {k: v.numpy().copy() for k, v in split_fused_experts(hf.state_dict()).items()}
    grad_norm, aux, local_experts, ep_size, dist_params = two_expert_parallel_ranks(hf, hf_state)
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
