"""Workload preset (fitted to the paper's figures), trace files, and the cluster model's checks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gyre.config import ConfigError
from gyre.sim.cost_model import ClusterModel
from gyre.sim.workload import NL2REPO, Workload, read_trace, write_trace


@pytest.mark.slow
def test_preset_reproduces_paper_duration_statistics():
    w = Workload.from_preset(NL2REPO, 0)
    d = np.array([[e.nominal_s / 3600 for e in w.group(i).execs] for i in range(20000)])
    assert d.mean() == pytest.approx(1.93, rel=0.02)                 # mean per rollout
    assert d.max(axis=1).mean() == pytest.approx(2.96, rel=0.02)     # mean per query (slowest of G)
    assert (d.max(axis=1) >= 4).mean() == pytest.approx(0.0951, abs=0.008)  # queries >= 4 h
    calls = np.array([e.calls for i in range(2000) for e in w.group(i).execs])
    tokens = np.array([e.tokens for i in range(2000) for e in w.group(i).execs])
    assert 200 <= calls.mean() <= 400 and tokens.mean() == pytest.approx(1e6, rel=0.05)


def test_groups_do_not_depend_on_visit_order():
    a, b = Workload.from_preset(NL2REPO, 3), Workload.from_preset(NL2REPO, 3)
    b.group(50)
    assert a.group(7) == b.group(7) and a.group(50) == b.group(50)
    assert Workload.from_preset(NL2REPO, 4).group(7) != a.group(7)


@pytest.mark.parametrize("suffix", ["csv", "json"])
def test_trace_round_trip(tmp_path, suffix):
    w = Workload.from_preset(NL2REPO, 1)
    groups = [w.group(i) for i in range(5)]
    path = tmp_path / f"trace.{suffix}"
    write_trace(path, groups)
    t = Workload.from_trace(path)
    assert t.group_size == NL2REPO.group_size
    for i, g in enumerate(groups):
        got = t.group(i)
        assert [e.nominal_s for e in got.execs] == pytest.approx([e.nominal_s for e in g.execs])
        assert [e.calls for e in got.execs] == [e.calls for e in g.execs]
        assert [e.tool_s for e in got.execs] == pytest.approx([e.tool_s for e in g.execs])
        assert [e.output_tokens for e in got.execs] == pytest.approx([e.output_tokens for e in g.execs])
    assert t.group(5) == t.group(0)  # wraps around


def test_trace_train_tokens_default_to_tokens(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps([{"execution_id": 1, "group": "a", "duration_s": 10, "calls": 3, "tokens": 500}]))
    assert read_trace(p)[0]["train_tokens"] == 500.0


@pytest.mark.parametrize("body, message", [
    ("execution_id,group,duration_s,calls\n1,a,5,2\n", "missing tokens"),
    ("execution_id,group,duration_s,calls,tokens\n1,a,-5,2,10\n", "positive"),
    ("execution_id,group,duration_s,calls,tokens\n1,a,x,2,10\n", "row 1"),
    ("execution_id,group,duration_s,calls,tokens\n1,a,5,2,10\n1,a,5,2,10\n", "duplicate"),
    ("execution_id,group,duration_s,calls,tokens\n1,a,5,2,10\n2,b,5,2,10\n3,b,5,2,10\n", "same size"),
    ("execution_id,group,duration_s,calls,tokens,output_tokens\n1,a,5,2,10,11\n", "exceed tokens"),
    ("execution_id,group,duration_s,calls,tokens,tool_s\n1,a,5,2,10,-1\n", "positive"),
])
def test_bad_traces_get_clear_errors(tmp_path, body, message):
    p = tmp_path / "bad.csv"
    p.write_text(body)
    with pytest.raises(ConfigError, match=message):
        Workload.from_trace(p)


def test_unknown_workload():
    with pytest.raises(ConfigError, match="not a preset"):
        Workload.named("no-such-thing", 0)


@pytest.mark.parametrize("kw, message", [
    (dict(nodes=32, cell_nodes=5), "does not divide"),
    (dict(nodes=32, cell_nodes=1, min_cell_nodes=2), "smallest cell"),
    (dict(push_s=-1.0), "push_s"),
    (dict(to_train_s=-0.1), "to_train_s"),
    (dict(train_tokens_per_s=0.0), "train_tokens_per_s"),
    (dict(nodes=0), "nodes"),
])
def test_cluster_model_rejects_bad_parameters(kw, message):
    with pytest.raises(ConfigError, match=message):
        ClusterModel(**kw)


def test_trace_without_token_split_gets_stated_defaults(tmp_path):
    from gyre.sim.workload import OUTPUT_SHARE, TOOL_SHARE
    p = tmp_path / "t.json"
    p.write_text(json.dumps([{"execution_id": 1, "group": "a", "duration_s": 100, "calls": 3, "tokens": 500}]))
    (e,) = Workload.from_trace(p).group(0).execs
    assert e.output_tokens == 500 * OUTPUT_SHARE and e.tool_s == 100 * TOOL_SHARE
    assert e.prefill_tokens == 500 - e.output_tokens
