"""Megatron-Core GPTModel as an exact clone of transformers' Qwen2 (CPU, world size 1)."""

import pytest
import torch

from gyre.batch import MicroBatch, causal_mask
from gyre.train.dist import init_megatron
from gyre.train.loss import token_logprobs
from gyre.train.toy import random_qwen2, tiny_qwen2_config


@pytest.fixture(scope="module")
def megatron():
    init_megatron(seed=0)
    from gyre.train import megatron_model

    return megatron_model


def _build(megatron, hf):
    model = megatron.build_gpt_model(hf.config)
    megatron.load_hf_weights(model, hf.state_dict(), hf.config)
    return model.eval()


def _causal(ids):
    B, S = ids.shape
    return torch.arange(S).expand(B, S), causal_mask([S] * B, S)


@pytest.mark.parametrize("tie", [False, True])
def test_logits_match_transformers(megatron, tie):
    hf = random_qwen2(tiny_qwen2_config(tie_word_embeddings=tie), seed=1)
    model = _build(megatron, hf)
    ids = torch.randint(0, hf.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    pos, mask = _causal(ids)
    with torch.no_grad():
        ours = model(ids, pos, mask)
        ref = hf(input_ids=ids).logits
    assert ref.abs().max() > 1.0  # a random model with large logits: layout bugs cannot hide
    assert torch.allclose(ours, ref, atol=1e-4, rtol=0), (ours - ref).abs().max()


def test_weight_round_trip_is_bit_identical(megatron):
    hf = random_qwen2(seed=2)
    model = _build(megatron, hf)
    back = megatron.megatron_to_hf(megatron.model_state(model), hf.config)
    ref = hf.state_dict()
    assert set(back) == set(ref)
    for k in ref:
        assert torch.equal(back[k], ref[k]), k


def test_qkv_layout_is_per_group(megatron):
    """linear_qkv rows: for each KV group, its query heads, then its key head, then its value head."""
    cfg = tiny_qwen2_config(hidden_size=8, heads=4, kv_heads=2)  # head_dim 2, 2 query heads per group
    q = torch.arange(8.0)[:, None].expand(8, 8)
    k = 100 + torch.arange(4.0)[:, None].expand(4, 8)
    v = 200 + torch.arange(4.0)[:, None].expand(4, 8)
    rows = megatron._pack_qkv(q, k, v, cfg)[:, 0].tolist()
    assert rows == [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]


def _tree_batch():
    """Root [5 6 7], branches [8 9] and [10 11 12] packed in one row; each token appears once."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    parent = [-1, 0, 1, 2, 3, 2, 5, 6]
    depth = [0, 1, 2, 3, 4, 3, 4, 5]
    S = len(parent)
    visible = torch.zeros(S, S, dtype=torch.bool)
    for i in range(S):
        j = i
        while j >= 0:
            visible[i, j] = True
            j = parent[j]
    # targets: every token after the root, predicted by its parent position
    pred = torch.tensor([parent[i] for i in range(3, S)] + [0, 1])
    tgt = torch.tensor([int(ids[0, i]) for i in range(3, S)] + [6, 7])
    T = len(tgt)
    mb = MicroBatch(ids, torch.tensor([depth]), (~visible)[None, None], pred, tgt,
                    torch.zeros(T), torch.ones(T), torch.ones(T), torch.zeros(T, dtype=torch.long),
                    torch.zeros(T, dtype=torch.long), temperature=0.7)
    mb.validate()
    paths = [[5, 6, 7, 8, 9], [5, 6, 7, 10, 11, 12]]
    # the same targets read from causal runs of each root-to-leaf path
    expected_src = [(0, 2, 8), (0, 3, 9), (1, 2, 10), (1, 3, 11), (1, 4, 12), (0, 0, 6), (0, 1, 7)]
    return mb, paths, expected_src


def _path_logprobs(logits_fn, paths, expected_src, temperature):
    """`temperature`: each target's [T]."""
    out = []
    for (p, i, t), temperature in zip(expected_src, temperature.tolist()):
        ids = torch.tensor([paths[p]])
        pos, mask = _causal(ids)
        logits = logits_fn(ids, pos, mask)[0, i].float()
        out.append(torch.log_softmax(logits / temperature, -1)[t])
    return torch.stack(out)


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_tree_packing_matches_paths_megatron(megatron, family):
    from gyre.train.toy import random_model, tiny_config

    hf = random_qwen2(seed=3) if family == "qwen2" else random_model(tiny_config(family), seed=3)
    model = _build(megatron, hf)
    mb, paths, src = _tree_batch()
    from gyre.train.tree_attention import TreeMask, kv_end_from_mask

    with torch.no_grad():
        packed = token_logprobs(model(mb.input_ids, mb.position_ids, mb.attention_mask), mb)
        ref = _path_logprobs(lambda i, p, m: model(i, p, m), paths, src, mb.temperature)
        # the core-attention seam: TreeCoreAttention given a TreeMask (blocks of 2 tokens)
        tree_mask = TreeMask.build(kv_end_from_mask(mb.attention_mask), block=2)
        tree = token_logprobs(model(mb.input_ids, mb.position_ids, tree_mask), mb)
        # depth positions matter: with 0..S-1 the second branch would be wrong
        naive = token_logprobs(model(mb.input_ids, torch.arange(8)[None], mb.attention_mask), mb)
    assert torch.allclose(packed, ref, atol=1e-5), (packed - ref).abs().max()
    assert torch.allclose(tree, ref, atol=1e-5), (tree - ref).abs().max()
    assert (naive - ref).abs().max() > 1e-2


def test_tree_packing_matches_paths_embedded():
    from gyre.config import TrainConfig
    from gyre.train.trainer import EmbeddedTrainer

    trainer = EmbeddedTrainer(TrainConfig(), random_qwen2(seed=3))
    mb, paths, src = _tree_batch()
    packed = trainer.logprobs(mb)

    def logits(ids, pos, mask):
        return trainer.model(ids)  # no mask: causal

    with torch.no_grad():
        ref = _path_logprobs(logits, paths, src, mb.temperature)
    assert torch.allclose(packed, ref, atol=1e-5), (packed - ref).abs().max()


def test_cpu_layer_pins_megatron_version(monkeypatch):
    import megatron.core

    from gyre.train import megatron_cpu

    monkeypatch.setattr(megatron.core, "__version__", "0.99.0")
    with pytest.raises(RuntimeError, match="megatron-core==0.16.1"):
        megatron_cpu.check_version()


# --- every family (gyre.model.megatron_names) ------------------------------------------------

@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "qwen2_moe"])
def test_families_match_transformers_and_round_trip(megatron, family):
    from gyre.model.spec import split_fused_experts
    from gyre.train.toy import random_model, tiny_config

    hf = random_model(tiny_config(family), seed=11, std=0.2)
    model = _build(megatron, hf)
    ids = torch.randint(0, hf.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    pos, mask = _causal(ids)
    with torch.no_grad():
        ours, ref = model(ids, pos, mask), hf(input_ids=ids).logits
    assert ref.abs().max() > 1.0
    assert torch.allclose(ours, ref, atol=1e-4, rtol=0), (family, (ours - ref).abs().max())
    back = megatron.megatron_to_hf(megatron.model_state(model), hf.config)
    want = split_fused_experts(hf.state_dict())
    assert set(back) == set(want)
    assert all(torch.equal(back[k], want[k]) for k in want)


def test_grouped_gemm_names_round_trip():
    from gyre.model import megatron_names as names

    sd = {"decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight": torch.ones(1),
          "decoder.layers.0.mlp.router.weight": torch.zeros(1)}
    grouped = names.to_grouped_gemm(sd)
    assert set(grouped) == {"decoder.layers.0.mlp.experts.linear_fc1.weight3", "decoder.layers.0.mlp.router.weight"}
    assert names.from_grouped_gemm(grouped).keys() == sd.keys()
