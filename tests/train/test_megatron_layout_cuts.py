"""The tensor- and pipeline-parallel cuts of gyre/train/megatron_layout.py, without processes:
the slices of every rank join back to the whole model, the gated-linear-unit fc1 as [gate; up]."""

from __future__ import annotations

import pytest
import torch

from gyre.model.families import ModelFormatError
from gyre.train.megatron_layout import Layout, _join, shard, split_dim


def _state(layers: int = 2) -> dict:
    gen = torch.Generator().manual_seed(0)
    out = {"embedding.word_embeddings.weight": torch.randn(8, 4, generator=gen),
           "decoder.final_layernorm.weight": torch.randn(4, generator=gen),
           "output_layer.weight": torch.randn(8, 4, generator=gen)}
    for i in range(layers):
        m = f"decoder.layers.{i}."
        out |= {m + "self_attention.linear_qkv.weight": torch.randn(12, 4, generator=gen),
                m + "self_attention.linear_qkv.bias": torch.randn(12, generator=gen),
                m + "self_attention.linear_proj.weight": torch.randn(4, 8, generator=gen),
                m + "mlp.linear_fc1.weight": torch.randn(16, 4, generator=gen),
                m + "mlp.linear_fc2.weight": torch.randn(4, 8, generator=gen),
                m + "input_layernorm.weight": torch.randn(4, generator=gen)}
    return out


def test_tensor_parallel_slices_join_to_the_whole():
    whole = _state()
    parts = [shard(whole, 2, tied=False, layout=Layout(tp_rank=r, tp_size=2)) for r in range(2)]
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    gate, up = whole[fc1].chunk(2)
    assert torch.equal(parts[1][fc1], torch.cat([gate[4:], up[4:]]))  # rank 1: its gate rows, its up rows
    assert parts[0]["decoder.layers.1.self_attention.linear_proj.weight"].shape == (4, 4)  # row-parallel
    assert torch.equal(parts[0]["decoder.layers.0.input_layernorm.weight"], whole["decoder.layers.0.input_layernorm.weight"])
    for name, t in whole.items():
        got = _join(name, [p[name] for p in parts]) if split_dim(name) is not None else parts[1][name]
        assert torch.equal(got, t), name


def test_pipeline_stages_number_their_layers_from_zero():
    whole = _state(layers=4)
    first, last = (shard(whole, 4, tied=False, layout=Layout(pp_rank=r, pp_size=2)) for r in range(2))
    assert torch.equal(last["decoder.layers.0.mlp.linear_fc2.weight"], whole["decoder.layers.2.mlp.linear_fc2.weight"])
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert "embedding.word_embeddings.weight" not in last and "decoder.final_layernorm.weight" in last
    assert len(first) + len(last) == len(whole)


def test_tied_embeddings_copy_to_the_last_stage():
    whole = _state()
    del whole["output_layer.weight"]
    last = shard(whole, 2, tied=True, layout=Layout(pp_rank=1, pp_size=2))
    assert torch.equal(last["output_layer.weight"], whole["embedding.word_embeddings.weight"])


def test_sizes_that_do_not_divide_are_refused():
    with pytest.raises(ModelFormatError, match="pipeline_parallel=3"):
        shard(_state(), 2, tied=False, layout=Layout(pp_size=3, pp_rank=0))
    with pytest.raises(ModelFormatError, match="tensor_parallel=3"):
        shard(_state(), 2, tied=False, layout=Layout(tp_size=3, tp_rank=0))


def test_training_at_pipeline_stages_is_refused_by_the_config():
    from gyre.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="train.pipeline_parallel = 2: .*pipeline schedule"):
        load_config(None, ["train.pipeline_parallel=2"])
    assert load_config(None, ["train.tensor_parallel=2"]).train.tensor_parallel == 2
