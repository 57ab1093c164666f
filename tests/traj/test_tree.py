"""Trajectory tree on hand-built executions: counts against the oracle, divergence never
rewrites history, call inputs are exactly the concatenated segments."""

from __future__ import annotations

import numpy as np
import pytest
from support.tree_oracle import Recorder, count_trie, count_tuples, tree_counts

from gyre.traj.tree import ROOT, Segment, TrajectoryTree

PROMPT = [90, 91]


def msg(key: str, n: int, role: str = "tool", base: int = 0) -> Segment:
    return Segment(key, list(range(base, base + n)), role)


class Conv:
    """A tiny harness: keeps the conversation it would send and re-sends outputs as context."""

    def __init__(self, tree: TrajectoryTree, *first: Segment):
        self.tree, self.msgs = tree, list(first)

    def call(self, out_key: str, out: list[int], role: str = "main", keep: bool = True, **kw):
        rec = self.tree.add_call(list(self.msgs), out_key, PROMPT, out, [-0.5] * len(out),
                                 agent_role=role, **kw)
        if keep:
            self.msgs.append(Segment(out_key, PROMPT + out, "assistant"))
        return rec


@pytest.fixture
def rec(monkeypatch):
    return Recorder().install(monkeypatch)


def check(tree: TrajectoryTree, rec: Recorder) -> None:
    assert tree_counts(tree) == count_tuples(rec.calls) == count_trie(rec.calls)
    assert not rec.rewritten
    for call, sent in zip(tree.calls, rec.calls):
        np.testing.assert_array_equal(tree.call_input_ids(call), sent.input_ids)
        np.testing.assert_array_equal(tree.call_output_ids(call), sent.output_ids)
        assert call.n_input == len(sent.input_ids) and call.n_output == len(sent.output_ids)


def test_linear_conversation_is_one_path(rec):
    t = TrajectoryTree()
    c = Conv(t, msg("sys", 5, "system"), msg("task", 3, "user", 10))
    for i in range(4):
        c.call(f"a{i}", [100 + i, 200 + i])
        c.msgs.append(msg(f"t{i}", 2 + i, "tool", 300))
    c.call("final", [7])
    check(t, rec)
    s = t.stats()
    assert (s.calls, s.leaves, s.unique_nodes) == (5, 1, 2 + 4 * 2 + 1)
    assert s.expanded_nodes == s.unique_nodes and s.expanded_tokens == s.unique_tokens
    # earlier outputs are interior target nodes on the one path
    path = t.path(t.leaves()[0])
    assert [t.nodes[i].is_target for i in path].count(True) == 5
    assert s.target_tokens == 4 * 2 + 1


def test_retry_branches_at_the_target(rec):
    t = TrajectoryTree()
    c = Conv(t, msg("sys", 4, "system"), msg("task", 3, "user"))
    c.call("a0", [1, 2])
    c.msgs.append(msg("t0", 3))
    first = c.call("cut", [5] * 9, keep=False, finish_reason="length")
    second = c.call("a1", [6, 6])
    c.msgs.append(msg("t1", 2))
    c.call("a2", [8])
    check(t, rec)
    assert t.nodes[first.leaf].parent == t.nodes[second.leaf].parent
    s = t.stats()
    assert s.leaves == 2
    assert s.expanded_nodes == 5 + 7  # the abandoned sample's path shares 4 nodes with the other


def test_identical_retry_reuses_the_node(rec):
    t = TrajectoryTree()
    c = Conv(t, msg("sys", 4, "system"))
    a = c.call("same", [3, 4], keep=False)
    b = c.call("same", [3, 4], keep=False)
    check(t, rec)
    assert a.leaf == b.leaf and len(t.nodes) == 2 and t.stats().calls == 2


def test_compaction_restarts_from_system_and_task(rec):
    t = TrajectoryTree()
    sys_, task = msg("sys", 6, "system"), msg("task", 4, "user", 20)
    c = Conv(t, sys_, task)
    for i in range(3):
        c.call(f"a{i}", [i + 1] * 3)
        c.msgs.append(msg(f"t{i}", 2, base=40 + i))
    summary = Conv(t, *c.msgs, msg("compact", 2, "user", 70)).call("sum", [9] * 4, role="compactor")
    after = Conv(t, sys_, task, msg("summary", 4, "user", 9))
    after.call("b0", [11])
    after.msgs.append(msg("u0", 3))
    after.call("b1", [12])
    check(t, rec)
    s = t.stats()
    assert s.leaves == 2
    roots = t.children(ROOT)
    assert len(roots) == 1  # system shared
    task_node = t.children(roots[0])
    assert len(task_node) == 1 and len(t.children(task_node[0])) == 2  # old branch / summary
    assert t.nodes[summary.leaf].agent_role == "compactor"


def test_subagent_starts_its_own_root(rec):
    t = TrajectoryTree()
    main = Conv(t, msg("sys", 6, "system"), msg("task", 4, "user"))
    main.call("delegate", [4, 4])
    sub = Conv(t, msg("sub-sys", 5, "system", 500), msg("brief", 2, "user", 4))
    sub.call("s0", [1], role="subagent:explore")
    sub.msgs.append(msg("st0", 2))
    answer = sub.call("s1", [2, 2], role="subagent:explore", keep=False)
    main.msgs.append(Segment("answer", [2, 2], "tool"))
    main.call("done", [0])
    check(t, rec)
    assert len(t.children(ROOT)) == 2
    assert t.nodes[t.path(answer.leaf)[0]].agent_role == "subagent:explore"
    assert t.stats().leaves == 2


def test_same_key_other_tokens_is_a_sibling_not_an_edit(rec):
    t = TrajectoryTree()
    t.add_call([msg("sys", 3, "system"), msg("tool", 2, base=1)], "x", PROMPT, [1], [0.0], agent_role="main")
    t.add_call([msg("sys", 3, "system"), msg("tool", 2, base=5)], "x", PROMPT, [1], [0.0], agent_role="main")
    check(t, rec)
    sys_id = t.children(ROOT)[0]
    kids = t.children(sys_id)
    assert len(kids) == 2 and t.find_child(sys_id, "tool") == kids[-1]


def test_output_equal_to_earlier_context_is_a_separate_target():
    # a context message and a later sampled output with the same key and ids: the sampled one
    # must stay a target (its log-probs train), so it is a new node beside the context one
    t = TrajectoryTree()
    sys_ = msg("sys", 3, "system")
    t.add_call([sys_, Segment("a", PROMPT + [4], "assistant")], "b", PROMPT, [5], [0.0], agent_role="main")
    rec = t.add_call([sys_], "a", PROMPT, [4], [-0.1], agent_role="main")
    sys_id = t.children(ROOT)[0]
    ctx, tgt = t._children[sys_id]["a"]
    assert rec.leaf == tgt and t.nodes[tgt].is_target and not t.nodes[ctx].is_target


def test_logprob_count_is_checked():
    with pytest.raises(ValueError, match="log-probs"):
        TrajectoryTree().add_call([msg("s", 2)], "x", PROMPT, [1, 2], [0.0], agent_role="main")


def test_from_parts_rebuilds_lookup_and_rejects_forward_parents():
    t = TrajectoryTree()
    c = Conv(t, msg("sys", 3, "system"))
    c.call("a", [1])
    c.msgs.append(msg("t", 2))
    c.call("b", [2])
    again = TrajectoryTree.from_parts(list(t.nodes), list(t.calls))
    assert again.stats() == t.stats() and again.leaves() == t.leaves()
    assert again.find_child(ROOT, "sys") == t.find_child(ROOT, "sys")
    bad = list(t.nodes)
    bad[1] = type(bad[1])(**{**bad[1].__dict__, "parent": 3})
    with pytest.raises(ValueError, match="parent"):
        TrajectoryTree.from_parts(bad, list(t.calls))
