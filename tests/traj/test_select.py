"""Selection: role priority with glob patterns, caps, main-only, deterministic ties, config parsing."""

from __future__ import annotations

import pytest

from gyre.config import ConfigError, SelectionConfig, load_config
from gyre.traj.select import SelectionSpec, rank_leaves, role_rank, select_leaves
from gyre.traj.tree import Segment, TrajectoryTree


def seg(key: str, n: int, base: int = 1) -> Segment:
    return Segment(key, [base + i for i in range(n)], "user")


def call(tree: TrajectoryTree, prefix: list[str], out_len: int, role: str, tag: str) -> int:
    """A call whose context is the messages ``prefix`` (3 tokens each) and whose output has
    ``out_len`` tokens; returns its target (leaf) node."""
    rec = tree.add_call([seg(k, 3) for k in prefix], tag, [7, 8], list(range(10, 10 + out_len)),
                        [-0.5] * out_len, agent_role=role)
    return rec.leaf


@pytest.fixture
def tree() -> tuple[TrajectoryTree, dict[str, int]]:
    t = TrajectoryTree()
    leaves = {
        "compactor": call(t, ["sys", "task", "a"], 9, "compactor", "c"),
        "main_short": call(t, ["sys", "task"], 2, "main", "m1"),
        "sub_explore": call(t, ["sys-sub", "brief"], 5, "subagent:explore", "s1"),
        "main_long": call(t, ["sys", "task", "b"], 6, "main", "m2"),
        "tool_user": call(t, ["sys", "other"], 20, "planner", "p"),
        "sub_test": call(t, ["sys-sub", "brief2"], 7, "subagent:test", "s2"),
        "main_tie": call(t, ["sys", "task", "c"], 6, "main", "m3"),
    }
    return t, leaves


def names(leaves: dict[str, int], ids: list[int]) -> list[str]:
    inv = {v: k for k, v in leaves.items()}
    return [inv[i] for i in ids]


def test_role_rank_globs_and_unknown_last():
    prio = ("main", "subagent:*", "compactor")
    assert role_rank("main", prio) == 0
    assert role_rank("subagent:explore", prio) == 1
    assert role_rank("subagent:", prio) == 1
    assert role_rank("compactor", prio) == 2
    assert role_rank("planner", prio) == 3
    assert role_rank("mainx", prio) == 3  # globs match whole names, not prefixes
    assert role_rank("Main", prio) == 3   # case-sensitive


def test_order_priority_then_targets_then_id(tree):
    t, leaves = tree
    order = names(leaves, rank_leaves(t, ["main", "subagent:*", "compactor"]))
    # main: longest target first; equal targets -> lower node id (main_long was created first)
    assert order == ["main_long", "main_tie", "main_short", "sub_test", "sub_explore",
                     "compactor", "tool_user"]


def test_cap_k(tree):
    t, leaves = tree
    assert names(leaves, select_leaves(t, SelectionSpec(k=2))) == ["main_long", "main_tie"]
    assert names(leaves, select_leaves(t, SelectionSpec(k=5)))[3:] == ["sub_test", "sub_explore"]
    assert len(select_leaves(t, SelectionSpec(k=100))) == 7


def test_all_and_main_only(tree):
    t, leaves = tree
    assert len(select_leaves(t, SelectionSpec(k="all"))) == 7
    # main-only: every main leaf, uncapped, regardless of the priority list
    main = select_leaves(t, SelectionSpec(k="main", role_priority=("compactor",)))
    assert names(leaves, main) == ["main_long", "main_tie", "main_short"]


def test_custom_priority_changes_order(tree):
    t, leaves = tree
    spec = SelectionSpec(k=3, role_priority=("subagent:t*", "compactor", "main"))
    assert names(leaves, select_leaves(t, spec)) == ["sub_test", "compactor", "main_long"]


def test_targets_on_path_count_not_only_leaf():
    # a leaf whose own output is short but whose path holds a long earlier output ranks first
    t = TrajectoryTree()
    first = t.add_call([seg("sys", 3)], "o1", [7], list(range(20, 32)), [-0.1] * 12, agent_role="main")
    out1 = Segment("o1", t.nodes[first.leaf].tokens, "assistant")  # re-sent with exact ids
    deep = t.add_call([seg("sys", 3), out1, seg("tool", 2, 50)], "o2", [7], [60, 61], [-0.1] * 2,
                      agent_role="main").leaf
    lone = t.add_call([seg("sys", 3), seg("u2", 2, 70)], "o3", [7], list(range(80, 85)),
                      [-0.1] * 5, agent_role="main").leaf
    assert first.leaf in t.path(deep)  # the earlier target node is reused as context
    assert rank_leaves(t, ["main"]) == [deep, lone]


def test_deterministic_and_empty():
    assert select_leaves(TrajectoryTree(), SelectionSpec(k="all")) == []
    t = TrajectoryTree()
    ids = [call(t, ["s", f"u{i}"], 4, "main", f"x{i}") for i in range(6)]
    assert select_leaves(t, SelectionSpec(k=3)) == ids[:3]  # all tied: node id order


@pytest.mark.parametrize("value,expected", [(5, 5), ("7", 7), (" ALL ", "all"), ("main", "main"),
                                            ("main-only", "main"), ("main_only", "main")])
def test_parse_k(value, expected):
    assert SelectionConfig.parse_k(value) == expected
    assert SelectionSpec(k=value).k == expected


@pytest.mark.parametrize("bad", [0, -3, "0", "five", "", "k5", True, 2.5, None])
def test_parse_k_rejects(bad):
    with pytest.raises(ConfigError, match="selection.k"):
        SelectionSpec(k=bad)


def test_config_validates_overrides_and_builds_spec():
    cfg = load_config(overrides=["selection.k=all", "selection.role_priority=['main','compactor']"])
    spec = SelectionSpec.from_config(cfg.selection)
    assert spec == SelectionSpec(k="all", role_priority=("main", "compactor"))
    assert load_config(overrides=["selection.k=3"]).selection.k == "3"
    with pytest.raises(ConfigError, match="selection.k"):
        load_config(overrides=["selection.k=zero"])
    with pytest.raises(ConfigError, match="selection.role_priority"):
        load_config(overrides=["selection.role_priority=['main', '']"])


def test_labels():
    assert [SelectionSpec(k=k).label for k in ("main", 5, "all")] == ["main_only", "k5", "all"]
