"""Hybrid Gated DeltaNet families (Qwen3-Next, Qwen3.5, Qwen3.5-MoE; issue 30): Gyre's trainer
module against transformers (logits and gradients), the tree scan (state and conv window forked
at branch points) against running every root path on its own, and the trainer's tree layout
against the expanded layout on random agent trees."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gyre.config import TrainConfig
from gyre.model.spec import split_fused_experts
from gyre.train.gated_deltanet import TreeScan
from gyre.train.hybrid import HybridLM
from gyre.train.toy import random_model, tiny_config
from gyre.traj.materialize import materialize, prepare_step
from gyre.traj.record import ExecutionRecord
from gyre.traj.select import SelectionSpec
from gyre.traj.synthetic import Lengths, Shape, generate

HYBRIDS = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]
VOCAB = 96


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny model's many small ops: on a loaded 2-core machine a second torch thread made
    them ~10x slower (measured), so these tests run single-threaded."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("family", HYBRIDS)
def test_trainer_module_equals_transformers(family):
    hf = random_model(tiny_config(family), seed=4, std=0.2)
    ours = HybridLM.from_transformers(hf)
    assert [layer.linear for layer in ours.model.layers] == [True, True, True, False]
    ids = torch.randint(0, VOCAB, (2, 70), generator=torch.Generator().manual_seed(0))  # 2 chunks
    want, got = hf(input_ids=ids).logits, ours(ids)
    scale = float(want.detach().abs().max())
    assert scale > 1.0
    # float32 rounding (a convolution summed in another order) grows through random layers
    assert float((got - want).detach().abs().max()) < 3e-4 * scale
    target = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    (want * target).sum().backward()
    (got * target).sum().backward()
    ref = split_fused_experts({n: p.grad for n, p in hf.named_parameters()})
    assert set(ref) == {n for n, _ in ours.named_parameters()}
    for name, p in ours.named_parameters():
        r = ref[name]
        assert torch.allclose(p.grad, r, atol=1e-3 * float(r.abs().max()) + 1e-6), name


def _tree_row():
    """A root (0..9), child A (10..15) with grandchildren A1 (16..19) and A2 (20..22), child B
    (23..27): kv_end = each token's subtree end; then 3 padding tokens."""
    spans = {"root": (0, 10, 28), "A": (10, 16, 23), "A1": (16, 20, 20), "A2": (20, 23, 23), "B": (23, 28, 28)}
    kv = torch.zeros(31, dtype=torch.long)
    for start, end, sub in spans.values():
        kv[start:end] = sub
    paths = [["root", "A", "A1"], ["root", "A", "A2"], ["root", "B"]]
    return kv, spans, paths


def test_tree_scan_forks_state_and_conv_window_at_branch_points():
    hf = random_model(tiny_config("qwen3_5"), seed=2, std=0.2)
    layer = HybridLM.from_transformers(hf).model.layers[0].linear_attn
    kv, spans, paths = _tree_row()
    tree = TreeScan.build(kv[None])
    assert tree.tokens == 28  # each real token once
    # cut after the branch points (end of root and end of A) and at every sibling start
    assert [(c.start, c.end, c.parent) for c in tree.calls] == [
        (0, 10, -1), (10, 16, 9), (16, 20, 15), (20, 23, 15), (23, 28, 9)]
    x = torch.randn(1, 31, 64, generator=torch.Generator().manual_seed(3))
    out = layer(x, tree)
    for path in paths:
        idx = torch.cat([torch.arange(*spans[n][:2]) for n in path])
        alone = layer(x[:, idx], TreeScan.build(torch.full((1, len(idx)), len(idx))))
        assert torch.allclose(out[0, idx], alone[0], atol=1e-5), path
    assert float(out[0, 28:].abs().max()) < 1e-3  # padding: zero output before the projection
    # the comparison can fail: scanning the row as one sequence differs on B
    flat = layer(x[:, :28], TreeScan.build(torch.full((1, 28), 28)))
    assert float((flat[0, 23:28] - out[0, 23:28]).abs().max()) > 1e-3


def _records(parallel_every=2):
    out = []
    for i in range(3):
        shape = Shape(calls=12, subagents=1, subagent_calls=3, compactions=1, retries=1,
                      parallel_every=parallel_every, system=Lengths(10, 0.1), task=Lengths(6),
                      assistant=Lengths(5), tool=Lengths(5), summary=Lengths(6), seed=i)
        tree = generate(shape).tree
        for n in tree.nodes:  # the tiny model's vocabulary; the tree keeps its structure
            n.tokens = (n.tokens % (VOCAB - 1) + 1).astype(np.int32)
        out.append(ExecutionRecord(f"e{i}", "t", 0, "done", [1.0, 0.0, 0.5][i], "tests", tree=tree))
    return out


def _loss_and_grads(trainer, mbs):
    losses = [trainer.forward_backward(mb)["loss"] for mb in mbs]
    grads = trainer.flat_grads().clone()
    trainer.clear_gradients()
    return losses, grads


# (qwen3_next: the same scan under another projection layout; in make test, not make test-fast)
@pytest.mark.parametrize("family", ["qwen3_5_moe", pytest.param("qwen3_next", marks=pytest.mark.slow)])
def test_tree_layout_equals_expanded_layout(family):
    """Retries, sub-agents, compactions and parallel tool calls: the tree-packed micro-batches give
    the expanded layout's loss and gradients, computing each unique token once."""
    from gyre.train.trainer import EmbeddedTrainer

    recs = _records()
    step = prepare_step(recs, SelectionSpec(k="all"), step_version=3)
    tree_mbs = list(materialize(step.executions, layout="tree", micro_batch_tokens=4096))
    exp_mbs = list(materialize(step.executions, layout="expanded", micro_batch_tokens=4096))
    hf = random_model(tiny_config(family, vocab_size=VOCAB), seed=1, std=0.2)

    def trainer(attention):
        cfg = TrainConfig(dtype="float32", clip=False, moe_aux_loss_coef=0.0)
        return EmbeddedTrainer(cfg, hf, device="cpu", attention=attention)

    losses, grads = _loss_and_grads(trainer("tree"), tree_mbs)
    ref_losses, ref = _loss_and_grads(trainer("dense"), exp_mbs)
    assert float(ref.abs().max()) > 1e-4
    assert losses == pytest.approx(ref_losses, rel=1e-4, abs=1e-6)
    assert float((grads - ref).abs().max()) < 1e-3 * float(ref.abs().max())
    unique = sum(r.tree.stats().unique_tokens for r in recs)
    assert sum(TreeScan.build(mb.kv_end).tokens for mb in tree_mbs) == unique
    assert sum(TreeScan.build(mb.kv_end).tokens for mb in exp_mbs) > unique
    # the comparison can fail: a branch started from the last token scanned, not its parent
    first = tree_mbs[0]
    S = first.input_ids.shape[1]
    n = int((first.kv_end[0] > torch.arange(S)).sum())
    flat = first.kv_end.clone()
    flat[0, :n] = n
    bad = type(first)(**{**first.__dict__, "kv_end": flat})
    t = trainer("tree")
    _, good = _loss_and_grads(t, [first])
    _, wrong = _loss_and_grads(t, [bad])
    assert float((wrong - good).abs().max()) > 0.01 * float(good.abs().max())


# --- serving ------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", HYBRIDS)
def test_engine_matches_transformers_and_resumes_from_stored_states(family, tmp_path):
    from gyre.engine.hybrid import causal_lm
    from gyre.engine.prefix_cache import PrefixCache
    from gyre.model.spec import load_weights, read_spec

    hf = random_model(tiny_config(family), seed=5, std=0.2)
    hf.save_pretrained(tmp_path / "m")
    spec = read_spec(tmp_path / "m")
    engine = causal_lm(spec, load_weights(tmp_path / "m", spec))
    ids = torch.randint(0, VOCAB, (1, 80), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = torch.log_softmax(hf(input_ids=ids).logits[0], -1)
    cache = engine.new_cache()
    first = torch.log_softmax(engine.forward(ids[0, :70].tolist(), cache), -1)
    assert float((first - ref[69]).abs().max()) < 2e-4
    other = engine.new_cache()
    engine.forward(ids[0, :5].tolist(), other)
    for j in range(70, 78):  # two sequences decode together: each keeps its own state
        lp = torch.log_softmax(engine.decode([int(ids[0, j]), 7], [cache, other])[0], -1)
        assert float((lp - ref[j]).abs().max()) < 2e-4, j
    # the prefix cache: a request extending the cached sequence resumes at its end; one sharing
    # only part of it resumes from the deepest stored state (the prompt's end) and recomputes
    prefix = PrefixCache()
    prefix.insert(ids[0, :78].tolist(), cache)
    full, n = prefix.lookup(ids[0, :80].tolist())
    assert n == 78 and full.length == 78
    # (for the last check: a copy holding the state at 78, taken before `full` moves on to 80; a
    # copy taken later resumes from the snapshot at 70, and lengthening that one by hand would read
    # KV positions 70-74 it never wrote: uninitialised memory, NaN on some runs)
    wrong = full.copy(78)
    assert wrong.length == 78
    lp = torch.log_softmax(engine.forward(ids[0, 78:80].tolist(), full), -1)
    assert float((lp - ref[79]).abs().max()) < 2e-4
    partial, n = prefix.lookup(ids[0, :75].tolist() + [1, 2])
    assert n == 70 and partial.length == 70  # 75 tokens shared; the state exists at 70
    lp = torch.log_softmax(engine.forward(ids[0, 70:75].tolist(), partial), -1)
    assert float((lp - ref[74]).abs().max()) < 2e-4
    # the comparison can fail: resuming at 75 from the state at 78 is wrong
    wrong.length = 75
    bad = torch.log_softmax(engine.forward([int(ids[0, 75])], wrong), -1)
    assert float((bad - ref[75]).abs().max()) > 1e-3


def test_sglang_launch_uses_the_hybrid_cache_flags(tmp_path):
    from gyre.engine.backends.sglang import is_hybrid as _is_hybrid
    from gyre.engine.sglang_flags import LAUNCH_SERVER_FLAGS
    from gyre.engine.sglang_launch import SGLangSpec

    random_model(tiny_config("qwen3_5"), seed=0).config.save_pretrained(tmp_path / "h")
    random_model(tiny_config("qwen3"), seed=0).config.save_pretrained(tmp_path / "d")
    assert _is_hybrid(tmp_path / "h") and not _is_hybrid(tmp_path / "d") and not _is_hybrid(tmp_path / "none")
    cmd = SGLangSpec(str(tmp_path / "h"), hybrid=True).command()
    i = cmd.index("--mamba-radix-cache-strategy")
    assert cmd[i + 1] == "extra_buffer" and cmd[cmd.index("--mamba-ssm-dtype") + 1] == "float32"
    assert {a for a in cmd if a.startswith("--")} <= LAUNCH_SERVER_FLAGS  # SGLang 0.5.23's own flags
    assert "--mamba-ssm-dtype" not in SGLangSpec(str(tmp_path / "d")).command()


# --- Megatron-Core --------------------------------------------------------------------------------

@pytest.mark.slow  # Megatron's import alone is ~5 CPU-s
def test_megatron_gdn_layer_forks_state_like_gyres():
    """Megatron-Core 0.16.1's GatedDeltaNet through `tree_forward` (its torch fallback kernel with
    the state in and out) equals Gyre's layer on a tree row: outputs and gradients."""
    from gyre.train.dist import init_megatron

    init_megatron(seed=0)
    from gyre.train.megatron_gdn import build_layer, load_from_gyre, tree_forward

    hf = random_model(tiny_config("qwen3_5"), seed=2, std=0.2)
    ours = HybridLM.from_transformers(hf).model.layers[0].linear_attn
    layer = build_layer(ours.spec)
    load_from_gyre(layer, ours)
    kv, spans, _ = _tree_row()
    tree = TreeScan.build(kv[None])
    x = torch.randn(1, 31, 64, generator=torch.Generator().manual_seed(3), requires_grad=True)
    want = ours(x, tree)
    got, bias = tree_forward(layer, x.transpose(0, 1), tree)
    got = got.transpose(0, 1)
    assert bias is None
    assert float((got - want)[:, :28].detach().abs().max()) < 1e-5 * float(want.detach().abs().max()) + 1e-5
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(4))
    (want[:, :28] * g[:, :28]).sum().backward()
    ref_x = x.grad.clone()
    x.grad = None
    (got[:, :28] * g[:, :28]).sum().backward()
    assert torch.allclose(x.grad, ref_x, atol=1e-4)
    assert torch.allclose(layer.A_log.grad, ours.A_log.grad, atol=1e-4)
    assert torch.allclose(layer.in_proj.weight.grad[: ours.in_proj_qkv.weight.shape[0]],
                          ours.in_proj_qkv.weight.grad, atol=1e-4)


@pytest.mark.slow  # transformers builds and saves the model (~20 s on the loaded 2-core machine)
def test_make_model_builds_a_tiny_hybrid(tmp_path, capsys):
    from gyre.cli import main
    from gyre.engine.hybrid import HybridCausalLM, causal_lm
    from gyre.model.spec import load_weights, read_spec

    assert main(["make-model", "--family", "qwen3_5_moe", "--out", str(tmp_path / "m")]) == 0
    spec = read_spec(tmp_path / "m")
    assert (spec.model_type, spec.hybrid, spec.experts, spec.full_layers) == ("qwen3_5_moe", True, 8, [3])
    assert isinstance(causal_lm(spec, load_weights(tmp_path / "m", spec)), HybridCausalLM)
    assert main(["make-model", "--family", "qwen3_5_moe", "--out", str(tmp_path / "m")]) == 0  # kept
    assert main(["make-model", "--family", "qwen3_5", "--out", str(tmp_path / "m")]) == 2
    assert "holds a qwen3_5_moe model, not qwen3_5" in capsys.readouterr().err
