"""The embedded trainer's model (gyre.train.qwen2) is transformers' Qwen2ForCausalLM: same
parameter names, same logits and gradients (tied and untied heads, grouped-query attention,
tree position ids, a dense mask), and it loads a model directory without transformers."""

from __future__ import annotations

import pytest
import torch

from gyre.model import ModelFormatError
from gyre.train.qwen2 import Qwen2LM
from gyre.train.toy import random_qwen2, tiny_qwen2_config


def _inputs(seed=0, B=2, S=12, vocab=96):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    # a tree row: two branches after a shared prefix of 6 (positions restart at the branch)
    pos = torch.cat([torch.arange(9), torch.arange(6, 9)])[None].expand(B, S).contiguous()
    causal = torch.ones(S, S, dtype=torch.bool).triu(1)
    mask = causal.clone()
    mask[9:, 6:9] = True  # the second branch does not see the first
    return ids, pos, mask[None, None].expand(B, 1, S, S)


def _hf_logits(hf, ids, pos, mask):
    # transformers' eager attention adds a float mask: 0 visible, the minimum where masked
    fmask = torch.zeros(mask.shape).masked_fill(mask, torch.finfo(torch.float32).min)
    return hf(input_ids=ids, position_ids=pos, attention_mask=fmask).logits


@pytest.mark.parametrize("tie", [False, True])
def test_logits_and_gradients_equal_transformers(tie):
    hf = random_qwen2(tiny_qwen2_config(tie_word_embeddings=tie), seed=4, std=0.2)
    ours = Qwen2LM.from_transformers(hf)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in hf.named_parameters()]
    assert ours.state_dict().keys() == hf.state_dict().keys()
    ids, pos, mask = _inputs()
    want, got = _hf_logits(hf, ids, pos, mask), ours(ids, pos, mask)
    assert float(want.detach().abs().max()) > 1.0  # the large init makes layout bugs visible
    assert torch.allclose(got, want, atol=2e-5), (got - want).abs().max()
    target = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    (want * target).sum().backward()
    (got * target).sum().backward()
    theirs = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        ref = theirs[name].grad
        assert torch.allclose(p.grad, ref, atol=1e-4 * float(ref.abs().max()) + 1e-6), name
    # the comparison can fail: a position change moves the logits
    assert not torch.allclose(ours(ids, torch.arange(12).expand(2, 12), mask), want, atol=1e-3)


def test_no_mask_is_causal():
    ours = Qwen2LM.from_transformers(random_qwen2(seed=5, std=0.2))
    ids = _inputs()[0]
    full = ours(ids)
    assert torch.allclose(ours(ids[:, :5]), full[:, :5], atol=1e-5)  # the prefix ignores the rest


def test_loads_a_model_directory(tmp_path):
    hf = random_qwen2(tiny_qwen2_config(tie_word_embeddings=True), seed=6)
    hf.save_pretrained(tmp_path / "m")
    ours = Qwen2LM.from_dir(tmp_path / "m")
    ids, pos, mask = _inputs()
    assert torch.allclose(ours(ids, pos, mask), _hf_logits(hf, ids, pos, mask), atol=2e-5)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight  # tied after loading
    theirs = hf.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in ours.state_dict().items())


def test_mismatched_weights_name_the_tensor():
    hf = random_qwen2(seed=7)
    state = hf.state_dict()
    state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"][:, :3]
    with pytest.raises(ModelFormatError, match="up_proj.weight has shape"):
        Qwen2LM.from_state(hf.config.to_dict(), state)
    del state["model.norm.weight"]
    with pytest.raises(ModelFormatError, match="missing .*model.norm.weight"):
        Qwen2LM.from_state(hf.config.to_dict(), state)
