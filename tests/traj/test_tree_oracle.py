"""An independent count of trajectory-tree statistics, and a recorder of what calls sent.

The oracle knows nothing of ``TrajectoryTree``'s node matching: every call is the sequence of
messages it sent (key + exact tokens) followed by its output; a node is a distinct prefix of
such a sequence. Two ways are given: literal prefix tuples (obviously right, quadratic) and a
dict trie (linear, for the case-study size); a test checks that they agree.
"""

from __future__ import annotations


import pytest

from gyre.traj.synthetic import Shape, generate
from support.tree_oracle import count_trie, count_tuples, Recorder


@pytest.mark.parametrize("shape", [
    Shape(calls=40, subagents=2, subagent_calls=4, compactions=2, retries=3, parallel_every=3, seed=1),
    Shape(calls=25, subagents=0, compactions=0, retries=0, seed=2),
])
def test_tuple_and_trie_oracles_agree(monkeypatch, shape):
    rec = Recorder().install(monkeypatch)
    generate(shape)
    assert count_tuples(rec.calls) == count_trie(rec.calls)
