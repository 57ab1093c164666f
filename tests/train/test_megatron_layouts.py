"""Megatron checkpoints at tensor parallel 2 and pipeline parallel 2 (two gloo ranks on the CPU)
hold the whole model and load at another layout; a TP 2 step equals the one-process step.

Before layout-aware checkpoints, a save wrote rank 0's own state: at TP 2 half of every split
weight, at PP 2 the first stage's layers only (the `own` shapes below), and loading it at TP 1
failed. Expert parallelism: tests/train/test_checkpoint_megatron.py."""

from __future__ import annotations

import functools

import pytest
import torch

from support import megatron_layouts as L
from support.gloo_ranks import spawned_ranks

pytestmark = pytest.mark.slow  # two spawned Megatron ranks over gloo


@pytest.fixture(scope="module")
def model():
    return L.model()


def _ranks(layout: dict, hf, hf_state, *, load=None, save=None, step: bool):
    [reply] = spawned_ranks(functools.partial(L.layout_rank, layout, load, save, step), hf.config, hf_state,
                            replies=1, timeout_s=240)
    return reply


def assert_same(want: dict, got: dict, atol: float):
    assert set(want) == set(got)
    for k, v in want.items():
        assert torch.allclose(v, torch.as_tensor(got[k]), atol=atol, rtol=0), k


def assert_whole(saved: dict, hf_state: dict):
    """Every parameter of the model at its full shape, weights and both Adam moments."""
    for key in ("model", "exp_avg", "exp_avg_sq"):
        assert {k: tuple(v.shape) for k, v in saved[key].items()} == {k: v.shape for k, v in hf_state.items()}, key


def test_tensor_parallel_2_steps_like_one_process_and_its_checkpoint_loads_there(model, tmp_path):
    hf, hf_state = model
    step, tp2, tp2_logits, stats, own = _ranks({"tensor_parallel": 2}, hf, hf_state, save=tmp_path / "tp2", step=True)
    one = L.trainer(hf.config, hf_state)
    ref = one.forward_backward(L.batch()) | one.optimizer_step()
    assert abs(stats["loss"] - ref["loss"]) < 1e-6 and abs(stats["grad_norm"] - ref["grad_norm"]) < 1e-5
    assert_same(one.hf_state_dict(), tp2, atol=1e-7)
    assert torch.allclose(L.logits(one, L.batch()), torch.from_numpy(tp2_logits), atol=1e-5)
    # rank 0 alone held half of each split weight; the file holds all of it
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert own[qkv][0] * 2 == hf_state["model.layers.0.self_attn.q_proj.weight"].shape[0] + \
        2 * hf_state["model.layers.0.self_attn.k_proj.weight"].shape[0]
    saved = L.saved(tmp_path / "tp2")
    assert_whole(saved, hf_state)

    loaded = L.trainer(hf.config, hf_state)
    loaded.load_checkpoint(tmp_path / "tp2")
    assert loaded.step == step == 1
    for t in (one, loaded):  # the next step continues the same run
        t.forward_backward(L.batch())
        t.optimizer_step()
    assert_same(one.hf_state_dict(), loaded.hf_state_dict(), atol=1e-7)


def test_one_process_checkpoint_loads_at_tensor_parallel_2(model, tmp_path):
    hf, hf_state = model
    one = L.trainer(hf.config, hf_state)
    one.forward_backward(L.batch())
    one.optimizer_step()
    one.save_checkpoint(tmp_path / "one")
    step, tp2, tp2_logits, _, _ = _ranks({"tensor_parallel": 2}, hf, hf_state, load=tmp_path / "one", step=True)
    one.forward_backward(L.batch())
    one.optimizer_step()
    assert step == one.step == 2
    assert_same(one.hf_state_dict(), tp2, atol=1e-7)
    assert torch.allclose(L.logits(one, L.batch()), torch.from_numpy(tp2_logits), atol=1e-5)
    assert not torch.allclose(one.hf_state_dict()["lm_head.weight"], torch.from_numpy(hf_state["lm_head.weight"]))


def test_pipeline_parallel_2_round_trips_a_checkpoint(model, tmp_path):
    """PP 1 -> PP 2 -> PP 1. The PP 2 trainer does not train (no pipeline schedule: its forward
    refuses, checked in the rank), so its checkpoint is the one it loaded, saved again by both stages."""
    hf, hf_state = model
    one = L.trainer(hf.config, hf_state)
    one.forward_backward(L.batch())
    one.optimizer_step()
    one.save_checkpoint(tmp_path / "pp1")
    step, pp2, pp2_logits, _, own = _ranks({"pipeline_parallel": 2}, hf, hf_state, load=tmp_path / "pp1",
                                           save=tmp_path / "pp2", step=False)
    assert step == 1
    assert_same(one.hf_state_dict(), pp2, atol=0)
    # the two stages' hand-run forward gives the one-process logits
    assert torch.allclose(L.logits(one, L.batch()), torch.from_numpy(pp2_logits), atol=1e-6)
    # rank 0 (the first stage) held layer 0 and the embedding only
    assert {n.split(".")[2] for n in own if n.startswith("decoder.layers.")} == {"0"}
    assert "output_layer.weight" not in own and "decoder.final_layernorm.weight" not in own
    before, after = L.saved(tmp_path / "pp1"), L.saved(tmp_path / "pp2")
    assert_whole(after, hf_state)
    for key in ("model", "exp_avg", "exp_avg_sq"):
        assert_same(before[key], after[key], atol=0)

    back = L.trainer(hf.config, hf_state)
    back.load_checkpoint(tmp_path / "pp2")
    for t in (one, back):
        t.forward_backward(L.batch())
        t.optimizer_step()
    assert back.step == one.step == 2
    assert_same(one.hf_state_dict(), back.hf_state_dict(), atol=0)


def test_moe_checkpoint_round_trips_through_tensor_parallel_2(tmp_path):
    """The routed experts are split over the expert-tensor group (Megatron's default: the TP
    size). One process -> TP 2 -> one process, Megatron's MoE layer in eval (it refuses to train at
    TP > 1 without sequence parallelism). The three together, TP 2 x PP 2 x EP 2 (eight ranks,
    ~85 s here, too slow for a test), run in benchmarks/bench_checkpoints.py."""
    from gyre.model.spec import split_fused_experts
    from support.megatron_moe import _model

    hf = _model()
    hf_state = {k: v.numpy().copy() for k, v in split_fused_experts(hf.state_dict()).items()}
    one = L.trainer(hf.config, hf_state)
    one.forward_backward(L.batch())
    one.optimizer_step()
    one.save_checkpoint(tmp_path / "one")
    step, whole, logits, _, own = _ranks({"tensor_parallel": 2}, hf, hf_state, load=tmp_path / "one",
                                         save=tmp_path / "tp2", step=False)
    assert step == 1
    assert_same(one.hf_state_dict(), whole, atol=0)
    assert torch.allclose(L.logits(one, L.batch()), torch.from_numpy(logits), atol=1e-5)
    # rank 0 holds half of each expert's [gate; up] rows: as many as one whole up projection
    fc1 = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    assert own[fc1][0] == hf_state["model.layers.0.mlp.experts.0.up_proj.weight"].shape[0]
    assert_whole(L.saved(tmp_path / "tp2"), hf_state)
    for key in ("model", "exp_avg", "exp_avg_sq"):
        assert_same(L.saved(tmp_path / "one")[key], L.saved(tmp_path / "tp2")[key], atol=0)
    back = L.trainer(hf.config, hf_state)
    back.load_checkpoint(tmp_path / "tp2")
    assert_same(one.hf_state_dict(), back.hf_state_dict(), atol=0)
