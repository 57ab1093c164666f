"""Every family of gyre.model, against transformers: the embedded trainer's module (logits and
gradients, tree position ids, a dense tree mask), the engine's forward (prefill and batched decode
log-probs) on a directory written by transformers' own save_pretrained, and the refusals."""

from __future__ import annotations

import json

import pytest
import torch

from gyre.engine.qwen import CausalLM
from gyre.model import ModelFormatError, supported
from gyre.model.spec import read_spec
from gyre.train.qwen2 import Qwen2LM
from gyre.train.toy import random_model, tiny_config

FAMILIES = ["qwen2", "llama", "qwen3", "qwen3_moe", "qwen2_moe"]


def _tree_inputs(B=2, S=12, vocab=96):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    pos = torch.cat([torch.arange(9), torch.arange(6, 9)])[None].expand(B, S).contiguous()
    mask = torch.ones(S, S, dtype=torch.bool).triu(1)
    mask[9:, 6:9] = True  # the second branch does not see the first
    return ids, pos, mask[None, None].expand(B, 1, S, S)


def _hf_logits(hf, ids, pos, mask):
    fmask = torch.zeros(mask.shape).masked_fill(mask, torch.finfo(torch.float32).min)
    return hf(input_ids=ids, position_ids=pos, attention_mask=fmask).logits


def _hf_grads(hf) -> dict[str, torch.Tensor]:
    """transformers' gradients under the checkpoint's names (fused experts split)."""
    from gyre.model.spec import split_fused_experts

    return split_fused_experts({n: p.grad for n, p in hf.named_parameters()})


@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_module_equals_transformers(family):
    hf = random_model(tiny_config(family), seed=4, std=0.2)
    ours = Qwen2LM.from_transformers(hf)
    ids, pos, mask = _tree_inputs()
    want, got = _hf_logits(hf, ids, pos, mask), ours(ids, pos, mask)
    assert float(want.detach().abs().max()) > 1.0
    assert torch.allclose(got, want, atol=3e-5), (got - want).abs().max()
    target = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    (want * target).sum().backward()
    (got * target).sum().backward()
    ref = _hf_grads(hf)
    assert set(ref) == {n for n, _ in ours.named_parameters()}
    for name, p in ours.named_parameters():
        r = ref[name]
        assert torch.allclose(p.grad, r, atol=1e-4 * float(r.abs().max()) + 1e-6), name


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_reads_save_pretrained_and_matches_transformers(family, tmp_path):
    hf = random_model(tiny_config(family), seed=5, std=0.2)
    hf.save_pretrained(tmp_path / "m")
    assert read_spec(tmp_path / "m").model_type == family
    engine = CausalLM.from_dir(tmp_path / "m")
    ids = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = torch.log_softmax(hf(input_ids=ids).logits[0], -1)
    cache = engine.new_cache()
    first = torch.log_softmax(engine.forward(ids[0, :7].tolist(), cache), -1)
    assert torch.allclose(first, ref[6], atol=3e-5), (first - ref[6]).abs().max()
    steps = [torch.log_softmax(engine.decode([int(t)], [cache])[0], -1) for t in ids[0, 7:]]
    for j, lp in enumerate(steps):
        assert torch.allclose(lp, ref[7 + j], atol=3e-5), (family, j, (lp - ref[7 + j]).abs().max())
    # the trainer loads the same directory: identical tensors
    trainer = Qwen2LM.from_dir(tmp_path / "m")
    with torch.no_grad():
        assert torch.allclose(torch.log_softmax(trainer(ids)[0], -1), ref, atol=3e-5)


def test_moe_routes_differently_per_token():
    """The MoE test can fail: the experts do differ and more than one expert is used."""
    hf = random_model(tiny_config("qwen3_moe"), seed=6, std=0.2)
    ours = Qwen2LM.from_transformers(hf)
    ours(_tree_inputs()[0])
    used = ours.model.layers[0].mlp.last_experts
    assert len(torch.unique(used)) > 1
    e0 = ours.model.layers[0].mlp.experts
    assert not torch.equal(e0[0].up_proj.weight, e0[1].up_proj.weight)


def test_unsupported_families_and_bad_hybrid_layers_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelFormatError, match="not supported; supported families: " + ", ".join(supported())):
        read_spec(tmp_path)
    cfg = tiny_config("qwen3_5").to_dict() | {"layer_types": ["linear_attention", "sliding_attention"] * 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFormatError, match="layer_types must list 4 entries"):
        read_spec(tmp_path)


def test_missing_expert_names_the_tensor():
    hf = random_model(tiny_config("qwen3_moe"), seed=7)
    from gyre.model.spec import split_fused_experts

    state = split_fused_experts(hf.state_dict())
    del state["model.layers.1.mlp.experts.2.up_proj.weight"]
    with pytest.raises(ModelFormatError, match="missing .*experts.2.up_proj"):
        Qwen2LM.from_state(hf.config.to_dict(), state)


def test_make_model_builds_a_family_and_refuses_to_overwrite_another(tmp_path, capsys):
    from gyre.cli import main

    assert main(["make-model", "--family", "qwen3_moe", "--out", str(tmp_path / "m")]) == 0
    spec = read_spec(tmp_path / "m")
    assert (spec.model_type, spec.experts, spec.top_k, spec.qk_norm) == ("qwen3_moe", 8, 2, True)
    assert CausalLM.from_dir(tmp_path / "m").spec.moe_layers == frozenset({0, 1})
    assert main(["make-model", "--family", "qwen2", "--out", str(tmp_path / "m")]) == 2
    assert "holds a qwen3_moe model, not qwen2" in capsys.readouterr().err
