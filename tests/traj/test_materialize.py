"""Materialization: targets counted once, per-execution averaging, budgets, data-parallel groups,
and the expanded and tree-packed layouts giving the same log-probs, loss and gradients on a
random Qwen2 model."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from gyre.batch import causal_kv_end
from gyre.train.loss import policy_loss, token_logprobs
from gyre.train.toy import random_qwen2, tiny_qwen2_config
from gyre.train.qwen2 import Qwen2LM
from gyre.train.tree_attention import TreeMask
from gyre.traj.materialize import (TreeArrays, balanced, best_fit, materialize, plan_micro_batches,
                                   prepare_step, union_preorder)
from gyre.traj.record import ExecutionRecord
from gyre.traj.select import SelectionSpec
from gyre.traj.synthetic import Lengths, Shape, case_study, generate
from gyre.traj.tree import Segment, TrajectoryTree

VOCAB = 96
LAYOUTS = ("expanded", "tree")


# -- executions ----------------------------------------------------------------------------

def hand_tree(rng: np.random.Generator, scale: int = 1) -> TrajectoryTree:
    """Main conversation with re-sent outputs (interior targets), a retry, a compaction, a
    sub-agent under its own root, an empty message and a target with no generation prompt."""
    t = TrajectoryTree()

    def msg(key: str, n: int, role: str = "user") -> Segment:
        return Segment(key, rng.integers(1, VOCAB, n * scale), role)

    def out(conv, key, role, n, prompt=(3, 4)):
        toks = rng.integers(1, VOCAB, n * scale).tolist()
        rec = t.add_call(conv, key, list(prompt), toks, (-rng.exponential(1.0, len(toks))).tolist(),
                         agent_role=role, policy_version=int(rng.integers(2, 5)))
        return Segment(key, t.nodes[rec.leaf].tokens, "assistant")

    sys_, task = msg("sys", 5, "system"), msg("task", 4)
    conv = [sys_, task]
    for i in range(4):
        if i == 2:
            out(conv, f"retry{i}", "main", 7)  # abandoned sample, same context
        conv = conv + [out(conv, f"a{i}", "main", 3 + i), msg(f"tool{i}", 2 + i, "tool")]
    conv.append(Segment("empty", np.zeros(0, np.int32), "user"))
    summary = out(conv + [msg("compact", 2)], "summary", "compactor", 5)
    conv = [sys_, task, Segment("sum", summary.tokens, "user")]
    for i in range(2):
        conv = conv + [out(conv, f"b{i}", "main", 4), msg(f"tool-b{i}", 3, "tool")]
    out(conv, "final", "main", 6)
    sub = [msg("sys-sub", 4, "system"), msg("brief", 3)]
    for i in range(2):
        sub = sub + [out(sub, f"s{i}", "subagent:explore", 3), msg(f"st{i}", 2, "tool")]
    # no generation prompt after an empty message: the first target is predicted by the last
    # token of the nearest non-empty ancestor
    out(sub + [Segment("empty2", np.zeros(0, np.int32), "user")], "s-final", "subagent:explore", 2,
        prompt=())
    return t


def record(i: int, tree: TrajectoryTree, reward: float, group: int = 0, task: str = "t"
           ) -> ExecutionRecord:
    return ExecutionRecord(f"e{i}", task, group, "done", reward, "tests", tree=tree)


def small_synthetic(seed: int) -> TrajectoryTree:
    shape = Shape(calls=14, subagents=1, subagent_calls=3, compactions=1, retries=1,
                  system=Lengths(10, 0.1), task=Lengths(6), assistant=Lengths(4), tool=Lengths(4),
                  summary=Lengths(6), seed=seed)
    tree = generate(shape).tree
    for n in tree.nodes:  # fit the tiny model's vocabulary; ids keep their tree structure
        n.tokens = (n.tokens % (VOCAB - 1) + 1).astype(np.int32)
    return tree


def records(scale: int = 1) -> list[ExecutionRecord]:
    rng = np.random.default_rng(0)
    return [record(0, hand_tree(rng, scale), 1.0), record(1, hand_tree(rng, scale), 0.0),
            record(2, small_synthetic(1), 0.5), record(3, small_synthetic(2), 0.25, group=1),
            record(4, hand_tree(rng, scale), 0.75, group=1)]


# -- model helpers -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Qwen2LM.from_transformers(random_qwen2(tiny_qwen2_config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64), seed=0, std=0.2))


def logits_of(model, mb, attention="dense"):
    if attention == "tree":  # the trainers' path: block-sparse attention from kv_end
        return model(mb.input_ids, mb.position_ids, TreeMask.build(mb.kv_end, block=16))
    return model(mb.input_ids, mb.position_ids, mb.dense_mask())  # dense: True = masked


def loss_and_grads(model, mat, attention="dense"):
    model.zero_grad()
    total = 0.0
    for mb in mat:
        loss, _ = policy_loss(logits_of(model, mb, attention), mb, clip=False)
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


def all_targets(mat):
    """Concatenated target fields of every micro-batch, sorted by key (exe, node, offset)."""
    keys, cols = [], {f: [] for f in ("target_ids", "old_logprobs", "weights", "advantages",
                                      "staleness", "execution_index")}
    for i in range(len(mat)):
        mb, k = mat.with_keys(i)
        mb.validate()
        keys.append(k)
        for f in cols:
            cols[f].append(getattr(mb, f).numpy())
    keys = np.concatenate(keys)
    order = np.lexsort(keys.T[::-1])
    return keys[order], {f: np.concatenate(v)[order] for f, v in cols.items()}


# -- tests ---------------------------------------------------------------------------------

def test_union_preorder_makes_subtrees_contiguous():
    tree = hand_tree(np.random.default_rng(1))
    a = TreeArrays.from_tree(tree)
    order = union_preorder(a.parent, tree.leaves())
    assert sorted(order.tolist()) == list(range(len(tree.nodes)))
    pos = {n: i for i, n in enumerate(order.tolist())}
    for n in tree.nodes:
        desc = [m.id for m in tree.nodes if n.id in tree.path(m.id)]
        span = sorted(pos[d] for d in desc)
        assert span == list(range(pos[n.id], pos[n.id] + len(desc)))


@pytest.mark.parametrize("k", ["all", 3, "main"])
@pytest.mark.parametrize("budget", [4096, 200])
def test_targets_once_with_recorded_values(k, budget):
    step = prepare_step(records(), SelectionSpec(k=k), step_version=6)
    for layout in LAYOUTS:
        mat = materialize(step.executions, layout=layout, micro_batch_tokens=budget)
        keys, cols = all_targets(mat)
        assert len(np.unique(keys, axis=0)) == len(keys)  # each target token exactly once
        assert len(keys) == sum(e.n_targets for e in step.executions) - n_unpredictable(step)
        for (x, node, off), tok, old in zip(keys, cols["target_ids"], cols["old_logprobs"]):
            n = step.executions[x].record.tree.nodes[node]
            assert tok == n.tokens[off] and off >= n.target_start
            assert old == n.logprobs[off - n.target_start]  # token truth: the engine's values


def n_unpredictable(step) -> int:
    """Targets at offset 0 of a root node have no predictor (none in these trees)."""
    return sum(1 for e in step.executions for n in e.nodes
               if e.record.tree.nodes[n].parent == -1 and e.record.tree.nodes[n].target_start == 0
               and e.record.tree.nodes[n].is_target)


def test_shared_targets_are_counted_once():
    rng = np.random.default_rng(2)
    tree = hand_tree(rng)
    # the retry leaf and the compactor leaf share the main targets a0, a1 on their paths
    step = prepare_step([record(0, tree, 1.0), record(1, hand_tree(rng), 0.0)],
                        SelectionSpec(k="all"), step_version=5)
    e = step.executions[0]
    retry, compactor = [next(l for l in e.leaves if tree.nodes[l].key == k) for k in ("retry2", "summary")]
    shared = {n for n in tree.path(retry) if tree.nodes[n].is_target} & set(tree.path(compactor))
    assert {tree.nodes[n].key for n in shared} == {"a0", "a1"}
    per_path = sum(tree.nodes[n].n_targets for l in e.leaves for n in tree.path(l)
                   if tree.nodes[n].is_target)
    assert e.n_targets < per_path
    for layout in LAYOUTS:
        keys, cols = all_targets(materialize(step.executions, layout=layout))
        mine = keys[:, 0] == 0
        assert mine.sum() == e.n_targets
        assert np.allclose(cols["weights"][mine], 1 / e.n_targets / 2)


@pytest.mark.parametrize("budget", [4096, 120])
def test_each_execution_weighs_one_over_n(budget):
    rng = np.random.default_rng(3)
    long_ex = record(0, hand_tree(rng, scale=8), 1.0)
    short_ex = record(1, hand_tree(rng, scale=1), -1.0)
    step = prepare_step([long_ex, short_ex], SelectionSpec(k="all"), step_version=4,
                        estimator="reward")
    assert step.executions[0].n_targets > 6 * step.executions[1].n_targets
    for layout in LAYOUTS:
        mat = materialize(step.executions, layout=layout, micro_batch_tokens=budget * 8)
        _, cols = all_targets(mat)
        sums = np.bincount(cols["execution_index"], weights=cols["weights"])
        assert np.allclose(sums, [0.5, 0.5], atol=1e-6)
        # a constant per-token loss of 1 times the advantage: +1 and -1 cancel; token-weighted
        # averaging would let the long execution win
        assert abs(float((cols["weights"] * cols["advantages"]).sum())) < 1e-6


def test_advantages_staleness_and_groups():
    rng = np.random.default_rng(4)
    recs = [record(0, hand_tree(rng), 1.0, group=0), record(1, hand_tree(rng), 0.0, group=0),
            record(2, hand_tree(rng), 0.5, group=0), record(3, hand_tree(rng), 0.9, group=0, task="u"),
            record(4, hand_tree(rng), 0.3, group=1)]
    grpo = [e.advantage for e in prepare_step(recs, SelectionSpec(k=2), step_version=9).executions]
    r = np.array([1.0, 0.0, 0.5])
    assert np.allclose(grpo[:3], (r - r.mean()) / (r.std(ddof=1) + 1e-6), atol=1e-6)
    assert grpo[3:] == [0.0, 0.0]  # groups of one: same group number but another task, or alone
    rloo = [e.advantage for e in prepare_step(recs, SelectionSpec(k=2), step_version=9,
                                              estimator="rloo").executions]
    assert np.allclose(rloo, [1.0 - 0.25, 0.0 - 0.75, 0.5 - 0.5, 0.0, 0.0])
    raw = prepare_step(recs, SelectionSpec(k=2), step_version=9, estimator="reward")
    assert [e.advantage for e in raw.executions] == pytest.approx([1.0, 0.0, 0.5, 0.9, 0.3])
    for e in raw.executions:
        assert e.staleness == 9 - e.record.min_version
    keys, cols = all_targets(materialize(raw.executions, layout="tree"))
    # each token carries its own node's lag, not its execution's oldest
    own = [9 - raw.executions[e].record.tree.nodes[n].policy_version for e, n, _ in keys.tolist()]
    assert cols["staleness"].tolist() == own and len(set(own)) > 1
    with pytest.raises(ValueError, match="estimator"):
        prepare_step(recs, SelectionSpec(k=2), step_version=9, estimator="ppo")
    with pytest.raises(ValueError, match="finite reward"):
        prepare_step([record(9, hand_tree(rng), float("nan"))], SelectionSpec(), step_version=1)


def test_executions_without_targets_are_skipped_not_counted():
    rng = np.random.default_rng(5)
    sub_only = TrajectoryTree()
    sub_only.add_call([Segment("s", [1, 2], "system")], "x", [3], [4, 5], [-1.0, -1.0],
                      agent_role="subagent:x")
    step = prepare_step([record(0, hand_tree(rng), 1.0), record(1, sub_only, 0.0),
                         record(2, TrajectoryTree(), 0.5)], SelectionSpec(k="main"), step_version=1)
    assert [e.record.execution_id for e in step.executions] == ["e0"]
    assert [s[0] for s in step.skipped] == ["e1", "e2"]
    assert step.executions[0].weight == pytest.approx(1 / step.executions[0].n_targets)


@pytest.mark.parametrize("budget", [60, 200, 400, 100000])
def test_budget_masks_and_token_counts(budget):
    step = prepare_step(records(), SelectionSpec(k="all"), step_version=5)
    unique = sum(e.n_tokens for e in step.executions)
    paths = [int(e.arrays.length[e.record.tree.path(l)].sum()) for e in step.executions for l in e.leaves]
    if budget < max(paths):
        with pytest.raises(ValueError, match="micro_batch_tokens"):
            materialize(step.executions, layout="tree", micro_batch_tokens=budget)
        return
    for layout in LAYOUTS:
        mat = materialize(step.executions, layout=layout, micro_batch_tokens=budget)
        computed = 0
        for mb in mat:
            B, S = mb.input_ids.shape
            assert B * S <= budget
            assert mb.attention_mask is None  # kv_end is the structure
            mask = mb.dense_mask()[:, 0]
            real = ~mask.diagonal(dim1=-2, dim2=-1)
            assert mask[~real].all() and mask.transpose(-1, -2)[~real].all()  # padding masked
            assert not (mb.input_ids[~real]).any()
            computed += mb.num_tokens
        assert computed == mat.stats.tokens
        if layout == "expanded":
            assert mat.stats.rows == len(paths) and computed == sum(paths)
        elif budget >= max(e.n_tokens for e in step.executions):
            assert computed == unique and mat.stats.tokens_over_unique == 1.0  # whole executions
            if budget >= unique:
                assert mat.stats.micro_batches == 1
        else:
            assert computed > unique  # split executions repeat the prefixes they need


def test_tree_logprobs_equal_causal_paths(model):
    step = prepare_step(records(), SelectionSpec(k="all"), step_version=5)
    # reference: each selected root-to-leaf path run on its own, causally, positions 0..L-1
    ref = {}
    with torch.no_grad():
        for e in step.executions:
            tree = e.record.tree
            for leaf in e.leaves:
                path = tree.path(leaf)
                ids = torch.as_tensor(np.concatenate([tree.nodes[n].tokens for n in path]), dtype=torch.long)
                logp = torch.log_softmax(model(ids[None])[0], -1)
                at = 0
                for n in path:
                    node = tree.nodes[n]
                    for off in range(node.target_start, len(node.tokens)):
                        ref[e.index, n, off] = float(logp[at + off - 1, ids[at + off]])
                    at += len(node.tokens)
    mat = materialize(step.executions, layout="tree", micro_batch_tokens=200)
    assert len(mat) > 1 and mat.stats.tokens > mat.stats.unique_tokens  # some executions split
    seen = 0
    with torch.no_grad():
        for i in range(len(mat)):
            mb, keys = mat.with_keys(i)
            got = token_logprobs(logits_of(model, mb), mb)
            want = torch.tensor([ref[tuple(k)] for k in keys.tolist()])
            assert torch.allclose(got, want, atol=1e-4), float((got - want).abs().max())
            seen += len(keys)
    assert seen == len(ref)


def test_layouts_same_loss_and_gradients(model):
    step = prepare_step(records(), SelectionSpec(k="all"), step_version=5)
    results = {}
    runs = [("expanded", 4096, "dense"), ("tree", 4096, "dense"), ("tree", 200, "dense"),
            ("expanded", 200, "dense"),
            ("tree", 4096, "tree"), ("expanded", 200, "tree")]  # the trainers' path
    for layout, budget, attention in runs:
        mat = materialize(step.executions, layout=layout, micro_batch_tokens=budget)
        results[layout, budget, attention] = loss_and_grads(model, mat, attention)
    ref_loss, ref_grads = results["expanded", 4096, "dense"]
    assert abs(ref_loss) > 1e-3
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    assert scale > 1e-4
    for key, (loss, grads) in results.items():
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6), key
        for name, g in grads.items():
            assert float((g - ref_grads[name]).abs().max()) < 1e-4 * scale, (key, name)


def test_loss_detects_a_wrong_mask(model):
    """The equivalence test can fail: a tree row run causally (no ancestry) changes the loss."""
    step = prepare_step(records()[:2], SelectionSpec(k="all"), step_version=5)
    mb = materialize(step.executions, layout="tree", micro_batch_tokens=4096)[0]
    S = mb.input_ids.shape[1]
    causal = replace(mb, kv_end=causal_kv_end([S], S))
    with torch.no_grad():
        good = float(policy_loss(logits_of(model, mb), mb, clip=False)[0])
        bad = float(policy_loss(logits_of(model, causal), causal, clip=False)[0])
    assert abs(good - bad) > 1e-3


def test_best_fit_packs_and_respects_capacity():
    bins = best_fit([7, 5, 4, 3, 2, 2, 1], lambda x: x, lambda x: 10)
    assert all(sum(b) <= 10 for b in bins) and len(bins) == 3
    assert sorted(x for b in bins for x in b) == [1, 2, 2, 3, 4, 5, 7]


def test_balanced_evens_the_bins_best_fit_needs_and_refuses_what_does_not_fit():
    units = [900, 800, 700, 600, 500, 300, 200]  # 4,000 in all: best-fit at 3,000 fills 3,000 + 1,000
    assert sorted(sum(b) for b in best_fit(units, lambda x: x, lambda x: 3000)) == [1000, 3000]
    bins = balanced(units, lambda x: x, 2, 3000)
    assert sorted(x for b in bins for x in b) == sorted(units)
    assert sorted(sum(b) for b in bins) == [2000, 2000]
    assert balanced([2000, 1500], lambda x: x, 1, 3000) is None  # needs 2 bins of 3,000
    assert balanced([5], lambda x: x, 3, 10) == [[5]]  # no empty micro-batch


def test_tree_micro_batches_are_even_where_best_fit_left_a_remainder():
    """A step's trainers take micro-batches by progress, so the step ends with its largest one:
    the tree layout keeps best-fit's number of micro-batches and evens their tokens out."""
    step = prepare_step(records(), SelectionSpec(k="all"), step_version=5)
    sizes = sorted(e.n_tokens for e in step.executions)
    budget = int(sum(sizes) * 0.75)  # two micro-batches: best-fit would fill one to ~0.75
    assert max(sizes) < sum(sizes) / 2, sizes  # units small enough to even out
    brim = sorted(sum(b) for b in best_fit(sorted(sizes, reverse=True), lambda x: x, lambda x: budget))
    plans = plan_micro_batches(step.executions, "tree", budget)
    loads = sorted(p.tokens for p in plans)
    assert len(plans) == len(brim) == 2 and sum(loads) == sum(sizes)
    assert brim[1] - brim[0] > 2 * min(sizes), brim  # best-fit's remainder (713 vs 369 tokens)
    assert loads[1] - loads[0] <= min(sizes), loads  # evened out: within one unit


def test_case_study_shape_runs_fast_and_tree_is_exact():
    recs = [case_study(seed=s, execution_id=f"c{s}", group=0) for s in range(2)]
    t0 = time.perf_counter()
    tokens = {}
    for k in ("main", 5, "all"):
        step = prepare_step(recs, SelectionSpec(k=k), step_version=10)
        budget = max(e.n_tokens for e in step.executions)
        for layout in LAYOUTS:
            st = materialize(step.executions, layout=layout, micro_batch_tokens=budget).stats
            tokens[k, layout] = st.tokens
            if layout == "tree":
                assert st.tokens == st.unique_tokens  # 1.00x: each unique token computed once
    assert time.perf_counter() - t0 < 15  # ~0.1 s here; a per-token Python loop would not pass
    assert tokens[5, "tree"] < tokens["all", "tree"] < tokens["all", "expanded"]
    assert tokens["main", "tree"] < tokens[5, "tree"]
