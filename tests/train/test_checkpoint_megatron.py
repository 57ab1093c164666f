"""Megatron checkpoints at expert parallel 2 hold every rank's experts and load at another layout.

Before layout-free checkpoints rank 0 wrote its own GPTModel state only: at expert parallel 2 that
is half of each layer's experts, and loading it in one process failed (or, at EP 2, gave rank 1
rank 0's experts)."""

from __future__ import annotations

import functools

import pytest
import torch

from support.gloo_ranks import spawned_ranks
from support.megatron_checkpoint import _ep2_rank, one_process
from support.megatron_moe import _model

pytestmark = pytest.mark.slow  # two spawned Megatron ranks over gloo


@pytest.fixture(scope="module")
def model():
    from gyre.model.spec import split_fused_experts

    hf = _model()
    return hf, {k: v.numpy().copy() for k, v in split_fused_experts(hf.state_dict()).items()}


def assert_same(want: dict, got: dict):
    assert set(want) == set(got)
    for k, v in want.items():
        assert torch.allclose(v, torch.as_tensor(got[k]), atol=1e-6), k


def test_saved_at_expert_parallel_2_loads_in_one_process(model, tmp_path):
    hf, hf_state = model
    [(step, ep2_after)] = spawned_ranks(functools.partial(_ep2_rank, tmp_path / "ep2", False), hf.config, hf_state,
                                        replies=1)
    step1, one_after = one_process(hf, hf_state, ckpt=tmp_path / "ep2")
    assert step == step1 == 2
    assert_same(one_after, ep2_after)  # every expert and Adam's moments came through
    k = "model.layers.1.mlp.experts.3.up_proj.weight"  # an expert of rank 1
    assert not torch.allclose(torch.from_numpy(ep2_after[k]), torch.from_numpy(hf_state[k]))


def test_saved_in_one_process_loads_at_expert_parallel_2(model, tmp_path):
    hf, hf_state = model
    step1, one_after = one_process(hf, hf_state, save=tmp_path / "one")
    [(step, ep2_after)] = spawned_ranks(functools.partial(_ep2_rank, tmp_path / "one", True), hf.config, hf_state,
                                        replies=1)
    assert step == step1 == 2
    assert_same(one_after, ep2_after)
