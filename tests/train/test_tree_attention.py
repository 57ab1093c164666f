"""Tree attention (gyre.train.tree_attention): the O(S) `kv_end` structure equals the dense mask,
the CPU block-sparse path equals dense attention (outputs and gradients), it skips the key
blocks no query can see, the FlexAttention mask_mod encodes the same mask, and both trainers
give the expanded layout's loss and gradients through it."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from gyre.batch import causal_kv_end, mask_from_kv_end
from gyre.config import TrainConfig
from gyre.train import tree_attention
from gyre.train.toy import random_qwen2, tiny_qwen2_config
from gyre.train.tree_attention import TreeMask, kv_end_from_mask, tree_mask_mod
from gyre.traj.materialize import materialize, prepare_step
from gyre.traj.record import ExecutionRecord
from gyre.traj.select import SelectionSpec
from gyre.traj.synthetic import Lengths, Shape, generate

VOCAB = 96


def records() -> list[ExecutionRecord]:
    out = []
    for i in range(3):
        shape = Shape(calls=12, subagents=1, subagent_calls=3, compactions=1, retries=1,
                      system=Lengths(10, 0.1), task=Lengths(6), assistant=Lengths(5), tool=Lengths(5),
                      summary=Lengths(6), seed=i)
        tree = generate(shape).tree
        for n in tree.nodes:  # the tiny model's vocabulary; the tree keeps its structure
            n.tokens = (n.tokens % (VOCAB - 1) + 1).astype(np.int32)
        out.append(ExecutionRecord(f"e{i}", "t", 0, "done", [1.0, 0.0, 0.5][i], "tests", tree=tree))
    return out


@pytest.fixture(scope="module")
def step():
    return prepare_step(records(), SelectionSpec(k="all"), step_version=3)


def batches(step, layout, budget):
    return list(materialize(step.executions, layout=layout, micro_batch_tokens=budget))


def dense_attention(q, k, v, mask, scale):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    w = (q @ k.transpose(2, 3)) * scale
    w = w.masked_fill(mask, torch.finfo(w.dtype).min)
    return torch.softmax(w, -1) @ v


@pytest.mark.parametrize("layout,budget", [("tree", 4096), ("tree", 300), ("expanded", 4096)])
def test_kv_end_is_the_dense_mask(step, layout, budget):
    for mb in batches(step, layout, budget):
        assert mb.attention_mask is None  # materialization builds no S x S mask
        dense = mb.dense_mask()  # on demand, for the dense path
        assert torch.equal(dense, mask_from_kv_end(mb.kv_end))
        assert torch.equal(kv_end_from_mask(dense), mb.kv_end)
    # a mask that is not of the tree form has no kv_end
    S = 6
    full = torch.zeros(1, 1, S, S, dtype=torch.bool)  # everything visible, future included
    assert kv_end_from_mask(full) is None
    assert torch.equal(mask_from_kv_end(causal_kv_end([4, 6], S)),
                       ~((torch.arange(S)[None, :] <= torch.arange(S)[:, None])[None]
                         & (torch.arange(S) < torch.tensor([[4], [6]]))[:, None, :]
                         & (torch.arange(S) < torch.tensor([[4], [6]]))[:, :, None])[:, None])


@pytest.mark.parametrize("layout,budget,block", [
    ("tree", 4096, 8), ("tree", 4096, 64), ("tree", 300, 16), ("tree", 300, 512),  # 512: one block
    ("expanded", 4096, 16), ("expanded", 4096, 64)])
def test_block_path_equals_dense_attention(step, layout, budget, block):
    g = torch.Generator().manual_seed(block)
    for mb in batches(step, layout, budget)[:2]:
        B, S = mb.input_ids.shape
        q = torch.randn(B, 4, S, 8, generator=g, requires_grad=True)
        k = torch.randn(B, 2, S, 8, generator=g, requires_grad=True)
        v = torch.randn(B, 2, S, 8, generator=g, requires_grad=True)
        real = (mb.kv_end > torch.arange(S))[:, None, :, None]  # padding outputs are unused
        w = torch.randn(B, 4, S, 8, generator=g) * real
        tm = TreeMask.build(mb.kv_end, block=block)
        got = tm.attend(q, k, v, 0.35)
        grads = torch.autograd.grad((got * w).sum(), (q, k, v))
        want = dense_attention(q, k, v, mb.dense_mask(), 0.35)
        ref = torch.autograd.grad((want * w).sum(), (q, k, v))
        assert torch.allclose(got * real, want * real, atol=1e-5)
        for a, b in zip(grads, ref):
            assert torch.allclose(a, b, atol=1e-5), float((a - b).abs().max())


def test_block_path_skips_what_no_query_sees(step):
    """Work follows the tree: a row of several executions skips every cross-execution block,
    and the pairs computed stay well under the causal square."""
    mb = batches(step, "tree", 4096)[0]
    assert len(mb.execution_index.unique()) > 1  # several executions share the row
    tm = TreeMask.build(mb.kv_end, block=16, chunk_pairs=16 * 16)  # chunks of one query block
    causal_blocks = tm.n_blocks * (tm.n_blocks + 1) // 2 * 16 * 16
    assert tm.pairs < 0.6 * causal_blocks
    exact = int((~mb.dense_mask()).sum())
    assert exact <= tm.pairs  # covers every visible pair (equality test above checks values)
    # two disjoint halves: no query block of the second needs a key block of the first
    ke = torch.tensor([[64] * 64 + [128] * 64])
    two = TreeMask.build(ke, block=16, chunk_pairs=16 * 16)  # one query block per chunk
    assert len(two.chunks) == 8
    for c in two.chunks:
        assert bool(((c.kv_blocks // 4) == c.q0 // 4).all()) and c.q1 == c.q0 + 1
    assert two.pairs == 2 * 10 * 16 * 16
    # larger chunks batch query blocks and still never cross into the other half
    big = TreeMask.build(ke, block=16, chunk_pairs=64 * 64)
    assert [(c.q0, c.q1) for c in big.chunks] == [(0, 4), (4, 8)]
    for c in big.chunks:  # each chunk's scores within the budget, its keys in its own half
        assert (c.q1 - c.q0) * 16 * len(c.kv_blocks) * 16 <= 64 * 64
        assert bool(((c.kv_blocks // 4) == c.q0 // 4).all())


def test_fully_visible_blocks_run_without_a_mask():
    """A chunk's key blocks that all its queries see whole are marked full (run unmasked); the
    diagonal and blocks whose subtree ends inside the chunk are not; both parts together give
    dense attention's outputs and gradients, padding included."""
    # keys 0..39 end at 40 (mid-block), 40..99 at 100, then 28 padding positions (kv_end 0)
    ke = torch.tensor([[40] * 40 + [100] * 60 + [0] * 28])
    tm = TreeMask.build(ke, block=16, chunk_pairs=16 * 16)  # one query block per chunk
    by_q0 = {c.q0: dict(zip(c.kv_blocks.tolist(), c.full.tolist())) for c in tm.chunks}
    assert by_q0[1] == {0: True, 1: False}           # block 0 seen whole by queries 16..31
    assert by_q0[2] == {0: False, 1: False, 2: False}  # keys 0..39 stop at 40: inside block 2
    assert by_q0[4] == {2: False, 3: True, 4: False}   # keys 40..47 of block 2 end at 100
    # 96..111: real queries see blocks 2..6, the padding ones none of them: all masked
    assert by_q0[6] == {b: False for b in range(2, 7)}
    assert 7 not in by_q0                               # all padding: nothing reads it
    assert any(all(f.values()) is False and any(f.values()) for f in by_q0.values())
    g = torch.Generator().manual_seed(3)
    S = ke.shape[1]
    q, k, v = (torch.randn(1, h, S, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    real = (torch.arange(S) < 100)[None, None, :, None]
    w = torch.randn(1, 4, S, 8, generator=g) * real
    got = tm.attend(q, k, v, 0.3)
    want = dense_attention(q, k, v, mask_from_kv_end(ke), 0.3)
    assert torch.allclose(got * real, want * real, atol=1e-5)
    for a, b in zip(torch.autograd.grad((got * w).sum(), (q, k, v)),
                    torch.autograd.grad((want * w).sum(), (q, k, v))):
        assert torch.allclose(a, b, atol=1e-5), float((a - b).abs().max())
    # the mask of the partly visible blocks is the predicate (a padding query sees itself)
    qpos, kpos = torch.arange(96, 128), torch.arange(0, 128)
    kend = ke[0, kpos]
    vis = ((kpos[None] <= qpos[:, None]) & (qpos[:, None] < kend[None])) | (kpos[None] == qpos[:, None])
    assert torch.equal(tree_attention._visible_mask(qpos, kpos, kend, torch.float32) == 0, vis)


@pytest.mark.slow  # importing FlexAttention's eager path pulls in torch._dynamo: ~5-10 s
def test_flex_mask_mod_is_the_tree_mask(step):
    """The CUDA path's mask_mod, run through FlexAttention's eager CPU forward, equals dense."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    mb = batches(step, "tree", 300)[0]
    B, S = mb.input_ids.shape
    bm = flex.create_block_mask(tree_mask_mod(mb.kv_end), B, None, S, S, device="cpu", BLOCK_SIZE=16)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, h, S, 8, generator=g) for h in (4, 2, 2))
    with warnings.catch_warnings():  # eager flex warns that it is the uncompiled reference
        warnings.simplefilter("ignore")
        got = flex.flex_attention(q, k, v, block_mask=bm, scale=0.35, enable_gqa=True)
    want = dense_attention(q, k, v, mb.dense_mask(), 0.35)
    assert torch.allclose(got, want, atol=1e-5)


def _loss_and_grads(trainer, mbs):
    losses = [trainer.forward_backward(mb)["loss"] for mb in mbs]
    grads = trainer.flat_grads().clone()
    trainer.clear_gradients()
    return losses, grads


def _trainer(backend, attention, seed=0):
    cfg = TrainConfig(backend=backend, dtype="float32", clip=False)
    hf = random_qwen2(tiny_qwen2_config(vocab_size=VOCAB), seed=seed, std=0.2)
    if backend == "megatron":
        from gyre.train.megatron_trainer import MegatronTrainer

        return MegatronTrainer(cfg, hf.config, hf.state_dict(), seed=seed, attention=attention)
    from gyre.train.trainer import EmbeddedTrainer

    return EmbeddedTrainer(cfg, hf, device="cpu", attention=attention)


# (Megatron's import alone is ~5 CPU-s: its case runs in make test, not make test-fast)
@pytest.mark.parametrize("backend", ["embedded", pytest.param("megatron", marks=pytest.mark.slow)])
def test_trainers_tree_path_equals_the_expanded_layout(step, backend, monkeypatch):
    """Tree layout through the tree path == expanded layout through the dense mask (the trainer
    before this path existed): same loss and gradients."""
    monkeypatch.setattr(tree_attention, "DEFAULT_BLOCK", 16)  # several blocks per row
    tree_mbs, exp_mbs = batches(step, "tree", 4096), batches(step, "expanded", 4096)
    losses, grads = _loss_and_grads(_trainer(backend, "tree"), tree_mbs)
    ref_losses, ref = _loss_and_grads(_trainer(backend, "dense"), exp_mbs)
    assert abs(sum(ref_losses)) > 1e-4 and float(ref.abs().max()) > 1e-4
    assert sum(losses) == pytest.approx(sum(ref_losses), rel=1e-5, abs=1e-7)
    assert float((grads - ref).abs().max()) < 1e-4 * float(ref.abs().max())
    # the comparison can fail: the first row run causally (kv_end of a plain row) changes its loss
    first = tree_mbs[0]
    S = first.input_ids.shape[1]
    bad = type(first)(**{**first.__dict__, "kv_end": causal_kv_end([S], S)})
    (bad_loss,), _ = _loss_and_grads(_trainer(backend, "tree"), [bad])
    assert abs(bad_loss - losses[0]) > 1e-4


def test_attention_path_is_checked():
    with pytest.raises(ValueError, match="attention 'sparse'"):
        _trainer("embedded", "sparse")
    with pytest.raises(ValueError, match="kv_end has shape"):
        mb = batches(prepare_step(records()[:1], SelectionSpec(k="all"), step_version=0),
                     "tree", 4096)[0]
        mb.kv_end = mb.kv_end[:, :-1]
        mb.validate()


def test_wire_carries_kv_end_not_the_square(step):
    from gyre.batch import from_wire, to_wire

    mb = batches(step, "tree", 4096)[0]
    S = mb.input_ids.shape[1]
    wire = to_wire(mb)
    assert "attention_mask" not in wire and wire["kv_end"].shape == (1, S)
    back = from_wire(wire)
    assert back.attention_mask is None and torch.equal(back.kv_end, mb.kv_end)
    assert sum(v.size for v in wire.values() if isinstance(v, np.ndarray)) < 16 * S  # O(S), not S^2
    # a micro-batch with an arbitrary dense mask still travels whole
    mb.attention_mask, mb.kv_end = mb.dense_mask(), None
    assert torch.equal(from_wire(to_wire(mb)).attention_mask, mb.attention_mask)
