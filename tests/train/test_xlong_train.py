"""xLong training path (issue 28): micro-batches carry `kv_end`, never an S x S mask, through row
selection and the wire; target log-probs come from hidden states in chunks with the gradients of
the full computation; per-layer recompute and the chunked CPU tree attention change memory, not
results; the case-study path trains one step end to end at a reduced scale."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from gyre.batch import MicroBatch, from_wire, select_rows, to_wire
from gyre.config import TrainConfig
from gyre.train import tree_attention
from gyre.train.logprobs import rows_at, target_logprobs
from gyre.train.loss import token_logprobs
from gyre.train.qwen2 import Qwen2LM
from gyre.cell.trainer_rank import rows_of
from gyre.train.toy import random_qwen2, tiny_qwen2_config
from gyre.train.trainer import EmbeddedTrainer
from gyre.traj.materialize import materialize, prepare_step
from gyre.traj.select import SelectionSpec
from gyre.traj.synthetic import CASE_STUDY, Lengths, Shape, generate, processed_tokens, scaled
from torch.utils._python_dispatch import TorchDispatchMode

VOCAB = 96


def _records(n=3, calls=12):
    out = []
    for i in range(n):
        shape = Shape(calls=calls, subagents=1, subagent_calls=3, compactions=1, retries=1,
                      system=Lengths(10, 0.1), task=Lengths(6), assistant=Lengths(5), tool=Lengths(5),
                      summary=Lengths(6), seed=i)
        rec = generate(shape, execution_id=f"e{i}")
        for node in rec.tree.nodes:  # the tiny model's vocabulary; the tree keeps its structure
            node.tokens = (node.tokens % (VOCAB - 1) + 1).astype(np.int32)
        rec.reward = [1.0, 0.0, 0.5][i % 3]
        out.append(rec)
    return out


@pytest.fixture(scope="module")
def step():
    return prepare_step(_records(), SelectionSpec(k="all"), step_version=3)


_MODEL: list[Qwen2LM] = []


def _trainer(**cfg):
    if not _MODEL:  # transformers builds it once (seconds); each trainer takes a copy
        _MODEL.append(Qwen2LM.from_transformers(random_qwen2(tiny_qwen2_config(vocab_size=VOCAB), seed=0, std=0.2)))
    return EmbeddedTrainer(TrainConfig(dtype="float32", off_policy="none", **cfg), copy.deepcopy(_MODEL[0]),
                           device="cpu")


# -- item 1: kv_end is the structure --------------------------------------------------------

def _distinct_batch() -> MicroBatch:
    """Three rows whose every field holds values that differ per row / per target."""
    B, S, T = 3, 5, 6
    mb = MicroBatch(
        input_ids=torch.arange(B * S).view(B, S), position_ids=torch.arange(B * S).view(B, S) + 100,
        attention_mask=None, pred_pos=torch.tensor([0, 3, 5, 6, 11, 14]),
        target_ids=torch.arange(T) + 10, old_logprobs=-torch.arange(T).float(),
        advantages=torch.arange(T).float() * 2, weights=torch.arange(T).float() + 0.5,
        staleness=torch.arange(T) + 1, execution_index=torch.arange(T) + 7, temperature=0.7,
        kv_end=torch.tensor([[5] * 5, [4] * 4 + [0], [3, 3, 3, 0, 0]]))
    mb.validate()
    return mb


def test_select_rows_carries_every_field():
    """Fails when a field of MicroBatch is dropped or not declared (iterates the dataclass)."""
    mb = _distinct_batch()
    got = select_rows(mb, [2, 0])
    S = 5
    for f in dataclasses.fields(MicroBatch):
        axis = f.metadata.get("axis")
        assert axis in ("row", "target", "scalar"), f"MicroBatch.{f.name} declares no axis"
        v, w = getattr(mb, f.name), getattr(got, f.name)
        if f.name == "pred_pos":
            assert w.tolist() == [S + 0, S + 3, 1, 4]  # row 0 -> 1, row 2 -> 0, in target order
        elif v is None:
            assert w is None, f.name
        elif axis == "row":
            assert torch.equal(w, v[[2, 0]]), f.name
        elif axis == "target":
            assert torch.equal(w, v[[0, 1, 4, 5]]), f.name
        else:
            assert w == v, f.name
    assert select_rows(mb, []) is None
    # the cell's ranks go through it: rows rank::size, and one rank is the batch itself
    assert torch.equal(rows_of(mb, 1, 2).kv_end, mb.kv_end[[1]]) and rows_of(mb, 0, 1) is mb


def test_a_field_without_an_axis_is_refused():
    @dataclasses.dataclass
    class Extended(MicroBatch):
        extra: torch.Tensor | None = None

    mb = Extended(**{f.name: getattr(_distinct_batch(), f.name) for f in dataclasses.fields(MicroBatch)})
    with pytest.raises(TypeError, match="extra declares no axis"):
        select_rows(mb, [0])


@pytest.mark.slow  # several trainer steps of the tiny model (> 3 s on 2 cores)
def test_multi_rank_cell_keeps_the_tree_path(step, monkeypatch):
    """Each rank's rows keep kv_end (no S x S mask anywhere), train through the tree attention,
    and sum to the gradients of the whole micro-batch."""
    mb = from_wire(to_wire(materialize(step.executions, layout="expanded", micro_batch_tokens=4096)[0]))
    assert mb.attention_mask is None and mb.input_ids.shape[0] >= 2
    built, dense = [], []
    real_build = tree_attention.TreeMask.build
    monkeypatch.setattr(tree_attention.TreeMask, "build",
                        classmethod(lambda cls, ke, **kw: built.append(ke.shape) or real_build(ke, **kw)))
    monkeypatch.setattr(MicroBatch, "dense_mask", lambda self: dense.append(1))
    whole, split = _trainer(), _trainer()
    whole.forward_backward(mb)
    for r in range(2):
        part = rows_of(mb, r, 2)
        assert part.kv_end is not None and part.attention_mask is None
        split.forward_backward(part)
    assert len(built) == 3 and not dense  # every forward took the tree path
    assert torch.allclose(whole.flat_grads(), split.flat_grads(), atol=1e-6)


def test_materialization_sends_o_of_s(step):
    mb = materialize(step.executions, layout="tree", micro_batch_tokens=4096)[0]
    S = mb.input_ids.shape[1]
    wire = to_wire(mb)
    assert "attention_mask" not in wire and mb.attention_mask is None
    assert max(v.size for v in wire.values() if isinstance(v, np.ndarray)) <= 2 * S


# -- item 2: chunked target log-probs ---------------------------------------------------------

@pytest.mark.parametrize("chunk", [1, 7, 4096])
@pytest.mark.parametrize("temperature", [None, 0.8, "per-target"])
def test_chunked_logprobs_equal_full_logits_with_gradients(chunk, temperature):
    g = torch.Generator().manual_seed(chunk)
    B, S, H, V, T = 2, 9, 16, 50, 13
    hidden = torch.randn(B, S, H, generator=g, requires_grad=True)
    head = torch.nn.Linear(H, V, bias=False)
    pred = torch.randint(0, B * S, (T,), generator=g)
    tgt = torch.randint(0, V, (T,), generator=g)
    temp = torch.rand(T, generator=g) + 0.5 if temperature == "per-target" else temperature
    got = target_logprobs(rows_at(hidden, pred), head, tgt, temperature=temp, chunk=chunk)
    logits = head(hidden).reshape(B * S, V)[pred]
    scale = temp[:, None] if isinstance(temp, torch.Tensor) else (temp or 1.0)
    want = torch.log_softmax(logits / scale, -1).gather(1, tgt[:, None])[:, 0]
    assert torch.allclose(got, want, atol=1e-6)
    w = torch.randn(T, generator=g)
    ga = torch.autograd.grad((got * w).sum(), (hidden, head.weight))
    gb = torch.autograd.grad((want * w).sum(), (hidden, head.weight))
    for a, b in zip(ga, gb):
        assert float(a.abs().max()) > 1e-4 and torch.allclose(a, b, atol=1e-6)
    # the seq-first layout (Megatron's [S, B, H]) selects the same rows
    assert torch.equal(rows_at(hidden.transpose(0, 1).contiguous(), pred, seq_first=True), rows_at(hidden, pred))


@pytest.mark.slow  # several trainer steps of the tiny model (> 3 s on 2 cores)
def test_trainer_logprobs_are_chunked_and_equal_the_full_logits(step):
    mb = materialize(step.executions, layout="tree", micro_batch_tokens=4096)[0]
    small, big = _trainer(logprob_chunk=5), _trainer()
    with torch.no_grad():
        full = token_logprobs(big._logits(mb), mb)  # the dense [B, S, V] reference
    assert torch.allclose(small.logprobs(mb), full, atol=1e-5)
    a, b = small.forward_backward(mb), big.forward_backward(mb)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert torch.allclose(small.flat_grads(), big.flat_grads(), atol=1e-6)
    with pytest.raises(ValueError, match="logprob_chunk"):
        target_logprobs(torch.zeros(2, 3), torch.nn.Identity(), torch.zeros(2, dtype=torch.long), chunk=0)


# -- item 3: recompute, chunked tree attention -------------------------------------------------

@pytest.mark.slow  # several trainer steps of the tiny model (> 3 s on 2 cores)
def test_recompute_gives_the_same_gradients(step):
    mb = materialize(step.executions, layout="tree", micro_batch_tokens=4096)[0]
    plain, again = _trainer(), _trainer(recompute=True)
    a, b = plain.forward_backward(mb), again.forward_backward(mb)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    ref = plain.flat_grads()
    assert float(ref.abs().max()) > 1e-4 and torch.allclose(again.flat_grads(), ref, atol=1e-6)


class _CountFlash(TorchDispatchMode):
    """Counts runs of the CPU flash kernel's forward (a recompute served from the selective
    checkpoint's cache never reaches this mode)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        return func(*args, **(kwargs or {}))


def test_recompute_keeps_the_attention_kernel_outputs():
    """With train.recompute a layer's backward reruns the layer but not the tree attention's
    kernel (its outputs are kept, O(S)); gradients equal the plain pass."""
    _trainer()  # builds the shared tiny model
    model = _MODEL[0]
    S = 256
    ids = torch.randint(1, VOCAB, (1, S), generator=torch.Generator().manual_seed(0))
    mask = tree_attention.TreeMask.build(torch.tensor([[160] * 160 + [S] * 96]), block=32)
    grads, runs = [], []
    for recompute in (False, True):
        model.zero_grad()
        with _CountFlash() as count:
            (model.hidden(ids, attention_mask=mask, recompute=recompute) ** 2).sum().backward()
        runs.append(count.n)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    model.zero_grad()
    parts = sum(1 + bool(c.full.any() and not c.full.all()) for c in mask.chunks)
    assert runs == [parts * len(model.model.layers)] * 2  # not twice that: nothing recomputed
    assert float(grads[0].abs().max()) > 1e-4 and torch.allclose(grads[1], grads[0], atol=1e-6)


def test_tree_attention_chunks_bound_the_scores():
    """Chunks keep each score matrix near the budget however long the row (never S x S)."""
    S, blk, budget = 4096, 64, 1 << 18
    ke = torch.tensor([[S] * S])  # one causal-like row: every key seen to the end
    tm = tree_attention.TreeMask.build(ke, block=blk, chunk_pairs=budget)
    assert len(tm.chunks) > 1 and tm.chunks[-1].q1 == S // blk
    for c in tm.chunks:
        assert c.q1 == c.q0 + 1 or (c.q1 - c.q0) * blk * len(c.kv_blocks) * blk <= budget


# -- the case-study path at a reduced scale ----------------------------------------------------

def test_scaled_shape_keeps_the_shape_and_grows_the_tokens():
    small = scaled(CASE_STUDY, 0.02)
    assert (small.calls, small.subagents, small.compactions, small.retries) == \
        (CASE_STUDY.calls, CASE_STUDY.subagents, CASE_STUDY.compactions, CASE_STUDY.retries)
    # token draws shift the random stream, so one seed's ratio is noisy; 636 calls average it out
    a = processed_tokens(generate(scaled(CASE_STUDY, 0.1)))
    b = processed_tokens(generate(scaled(CASE_STUDY, 0.2)))
    assert 1.8 < b / a < 2.2, b / a
    with pytest.raises(ValueError, match="factor"):
        scaled(CASE_STUDY, 0)


@pytest.mark.slow  # several trainer steps of the tiny model (> 3 s on 2 cores)
def test_case_study_shape_trains_one_step_tree_k5():
    """The bench's end-to-end check (tree layout, K = 5) on the case-study shape scaled down:
    selection, materialization in one row per execution, a chunked, recomputed train step."""
    # every event of the case study (3 sub-agents, 3 compactions, 3 retries: 10 leaves) on
    # fewer, shorter calls
    rec = generate(scaled(dataclasses.replace(CASE_STUDY, calls=96, subagent_calls=6, parallel_every=0), 0.02))
    for node in rec.tree.nodes:
        node.tokens = (node.tokens % (VOCAB - 1) + 1).astype(np.int32)
    assert len(rec.tree.leaves()) == 10
    st = prepare_step([rec], SelectionSpec(k=5), step_version=10, estimator="reward")  # as the bench
    e = st.executions[0]
    assert len(e.leaves) == 5
    mat = materialize(st.executions, layout="tree", micro_batch_tokens=e.n_tokens)
    trainer = _trainer(recompute=True, logprob_chunk=256)
    for mb in mat:
        assert mb.attention_mask is None
        trainer.forward_backward(mb)
    out = trainer.optimizer_step()
    assert out["targets"] == mat.stats.target_tokens and out["grad_norm"] > 0
