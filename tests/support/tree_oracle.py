"""Two independent oracles of a tree's node and token counts (a tuple set and a trie over what the proxy sent), and a recorder of the calls the tree was given."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from gyre.traj import tree as tree_mod


@dataclass
class SentCall:
    items: list[tuple[str, bytes]]    # (key, token bytes): inputs, then the target
    lengths: list[int]
    n_output: int
    input_ids: np.ndarray
    output_ids: np.ndarray


@dataclass
class Counts:
    calls: int
    leaves: int
    unique_nodes: int
    expanded_nodes: int
    unique_tokens: int
    expanded_tokens: int
    target_tokens: int


def sent_call(segments, target_key, prompt, output) -> SentCall:
    segs = [(s.key, np.asarray(s.tokens, np.int32)) for s in segments]
    target = np.asarray(list(prompt) + list(output), np.int32)
    items = [(k, t.tobytes()) for k, t in segs] + [(target_key, target.tobytes())]
    input_ids = np.concatenate([t for _, t in segs] + [np.asarray(prompt, np.int32)])
    return SentCall(items, [len(t) for _, t in segs] + [len(target)], len(output), input_ids,
                    np.asarray(output, np.int32))


def count_tuples(calls: list[SentCall]) -> Counts:
    """Unique prefixes as literal tuples; leaves are prefixes that are nobody's parent."""
    prefixes: dict[tuple, int] = {}     # prefix -> its last item's token count
    targets: dict[tuple, int] = {}
    for c in calls:
        for i in range(1, len(c.items) + 1):
            prefixes[tuple(c.items[:i])] = c.lengths[i - 1]
        targets[tuple(c.items)] = c.n_output
    parents = {p[:-1] for p in prefixes}
    leaves = [p for p in prefixes if p not in parents]
    return Counts(len(calls), len(leaves), len(prefixes), sum(len(p) for p in leaves),
                  sum(prefixes.values()),
                  sum(sum(prefixes[p[:i]] for i in range(1, len(p) + 1)) for p in leaves),
                  sum(targets.values()))


def count_trie(calls: list[SentCall]) -> Counts:
    """The same counts with prefixes numbered through a dict trie."""
    ids: dict[tuple[int, tuple[str, bytes]], int] = {}
    parent, depth, tok, tokdepth, targets = [], [], [], [], {}
    for c in calls:
        cur = -1
        for item, n in zip(c.items, c.lengths):
            nxt = ids.get((cur, item))
            if nxt is None:
                nxt = ids[(cur, item)] = len(parent)
                parent.append(cur)
                depth.append(1 + (depth[cur] if cur >= 0 else 0))
                tok.append(n)
                tokdepth.append(n + (tokdepth[cur] if cur >= 0 else 0))
            cur = nxt
        targets[cur] = c.n_output
    parents = set(parent)
    leaves = [i for i in range(len(parent)) if i not in parents]
    return Counts(len(calls), len(leaves), len(parent), sum(depth[i] for i in leaves), sum(tok),
                  sum(tokdepth[i] for i in leaves), sum(targets.values()))


@dataclass
class Recorder:
    """Patches ``TrajectoryTree.add_call`` to keep what each call sent, and a snapshot of every
    node as first created so later calls can be checked not to have rewritten it."""

    calls: list[SentCall] = field(default_factory=list)
    snapshots: dict[tuple[int, int], tuple] = field(default_factory=dict)
    rewritten: list[str] = field(default_factory=list)
    # every tree seen stays alive, so id(tree) is never reused by a later tree (snapshots are
    # keyed by it; a recycled id made fresh nodes look "rewritten")
    trees: list = field(default_factory=list)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> "Recorder":
        original = tree_mod.TrajectoryTree.add_call
        rec = self

        def add_call(tree, segments, target_key, prompt_tokens, output_tokens, logprobs, **kw):
            rec.calls.append(sent_call(segments, target_key, prompt_tokens, output_tokens))
            out = original(tree, segments, target_key, prompt_tokens, output_tokens, logprobs, **kw)
            rec.check(tree)
            return out

        monkeypatch.setattr(tree_mod.TrajectoryTree, "add_call", add_call)
        return self

    def check(self, tree) -> None:
        if not any(t is tree for t in self.trees):
            self.trees.append(tree)
        for n in tree.nodes:
            snap = (n.parent, n.key, n.tokens.tobytes(), n.target_start, n.logprobs.tobytes(),
                    n.message_role, n.agent_role, n.policy_version, n.call_index)
            old = self.snapshots.setdefault((id(tree), n.id), snap)
            if old != snap:
                self.rewritten.append(f"node {n.id} changed")


def tree_counts(tree) -> Counts:
    s = tree.stats()
    return Counts(s.calls, s.leaves, s.unique_nodes, s.expanded_nodes, s.unique_tokens,
                  s.expanded_tokens, s.target_tokens)
