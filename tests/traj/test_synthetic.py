"""Synthetic executions: shapes as asked, counts against the independent oracle, the case study."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from support.tree_oracle import Recorder, count_trie, count_tuples, tree_counts

from gyre.traj.synthetic import (CASE_STUDY, GEN_PROMPT, IM_END, Lengths, Shape, case_study, generate,
                                 generate_group)
from gyre.traj.tree import ROOT

SHAPES = [
    Shape(calls=30, subagents=0, compactions=0, retries=0, seed=1),
    Shape(calls=30, subagents=0, compactions=0, retries=4, seed=2),
    Shape(calls=40, subagents=0, compactions=3, retries=0, seed=3),
    Shape(calls=50, subagents=3, subagent_calls=5, compactions=0, retries=0, seed=4),
    Shape(calls=80, subagents=2, subagent_calls=6, compactions=2, retries=3, parallel_every=4,
          versions_every=10, seed=5),
]


@pytest.mark.parametrize("shape", SHAPES)
def test_counts_match_oracle_and_history_is_never_rewritten(monkeypatch, shape):
    rec = Recorder().install(monkeypatch)
    r = generate(shape)
    t = r.tree
    assert tree_counts(t) == count_tuples(rec.calls) == count_trie(rec.calls)
    assert not rec.rewritten
    for call, sent in zip(t.calls, rec.calls):
        np.testing.assert_array_equal(t.call_input_ids(call), sent.input_ids)
    s = t.stats()
    assert s.calls == shape.calls
    # leaves: each compaction ends a branch, the final main branch, each sub-agent, each retry
    assert s.leaves == shape.compactions + 1 + shape.subagents + shape.retries


@pytest.mark.parametrize("shape", SHAPES)
def test_shape_shows_in_roles_and_roots(shape):
    t = generate(shape).tree
    roles = [c.agent_role for c in t.calls]
    assert roles.count("compactor") == shape.compactions
    assert sum(r.startswith("subagent:") for r in roles) == shape.subagents * shape.subagent_calls
    assert sum(c.finish_reason == "length" for c in t.calls) == shape.retries
    roots = t.children(ROOT)
    names = {shape.subagent_names[k % len(shape.subagent_names)] for k in range(shape.subagents)}
    assert len(roots) == 1 + len(names)  # the main system prompt + one per sub-agent prompt
    for nid in roots:
        assert t.nodes[nid].message_role == "system"
    # a re-sent output is the generation prompt + the sampled ids, ending with <|im_end|>
    for c in t.calls:
        leaf = t.nodes[c.leaf]
        np.testing.assert_array_equal(leaf.tokens[:leaf.target_start], GEN_PROMPT)
        assert leaf.tokens[-1] == IM_END


def test_compaction_restart_shares_system_and_task():
    t = generate(Shape(calls=30, subagents=0, compactions=2, retries=0, seed=7)).tree
    (sys_id,) = t.children(ROOT)
    (task_id,) = t.children(sys_id)
    assert len(t.children(task_id)) == 3  # first conversation + one restart per compaction


def test_seed_changes_tokens_not_shape():
    a, b = generate(replace(SHAPES[-1], seed=10)), generate(replace(SHAPES[-1], seed=11))
    sa, sb = a.tree.stats(), b.tree.stats()
    assert (sa.unique_nodes, sa.expanded_nodes, sa.leaves) == (sb.unique_nodes, sb.expanded_nodes, sb.leaves)
    assert sa.unique_tokens != sb.unique_tokens
    c = generate(replace(SHAPES[-1], seed=10))
    assert c.tree.stats() == sa
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a.tree.nodes, c.tree.nodes))


def test_records_are_evaluated_executions():
    rs = generate_group(Shape(calls=20, seed=3, versions_every=5), 3, task="t/1", group=4, t0=1000.0)
    assert [r.execution_id for r in rs] == ["t/1-g4-e0", "t/1-g4-e1", "t/1-g4-e2"]
    for r in rs:
        assert r.task == "t/1" and r.group == 4 and r.status == "done" and r.reward_source == "tests"
        assert 0 <= r.passed <= r.total and r.reward == pytest.approx(r.passed / r.total)
        assert r.t_start == 1000.0 < r.tree.calls[0].t_start + 1e-9 <= r.tree.calls[-1].t_end <= r.t_end
        assert (r.min_version, r.max_version) == (0, 3)


def test_impossible_shape_is_refused():
    with pytest.raises(ValueError, match="calls"):
        generate(Shape(calls=10, subagents=2, subagent_calls=5))


@pytest.mark.slow  # the full 636-call case study, every call recorded for the oracle: ~10 s
def test_case_study_matches_the_paper_shape(monkeypatch):
    rec = Recorder().install(monkeypatch)
    r = case_study()
    s = r.tree.stats()
    assert count_trie(rec.calls) == tree_counts(r.tree)
    assert s.calls == CASE_STUDY.calls == 636 and s.leaves == 10
    # paper: 1,347 unique message nodes vs 1,716 independent occurrences (1.274x)
    assert abs(s.unique_nodes - 1347) <= 20 and abs(s.expanded_nodes - 1716) <= 25
    assert s.expanded_nodes / s.unique_nodes == pytest.approx(1716 / 1347, abs=0.01)
    assert s.expanded_tokens > s.unique_tokens


def test_random_shapes_hold_their_counts(monkeypatch):
    rec = Recorder().install(monkeypatch)
    rng = np.random.default_rng(42)
    built = 0
    for _ in range(40):
        shape = Shape(calls=int(rng.integers(3, 60)), subagents=int(rng.integers(0, 4)),
                      subagent_calls=int(rng.integers(1, 5)), compactions=int(rng.integers(0, 4)),
                      retries=int(rng.integers(0, 4)), parallel_every=int(rng.integers(0, 4)),
                      retry_phase=float(rng.random()), seed=int(rng.integers(1000)),
                      assistant=Lengths(8, 0.5), tool=Lengths(8, 0.5), system=Lengths(16, 0.1))
        try:
            shape.validate()
            r = generate(shape)
        except ValueError:
            continue  # too many events for the calls: refused, never silently reshaped
        built += 1
        s = r.tree.stats()
        assert s.calls == shape.calls
        assert s.leaves == shape.compactions + 1 + shape.subagents + shape.retries
        assert tree_counts(r.tree) == count_trie(rec.calls[-shape.calls:])
    assert built >= 20
    assert not rec.rewritten
