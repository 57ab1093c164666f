"""Token truth (issue 29): sampling parameters recorded and reproduced, each token's own policy
lag, and the token-identity audit of what a step trains."""

from __future__ import annotations

import logging

import h5py
import numpy as np
import pytest
import torch
from numpy.lib import recfunctions as rfn

from gyre.engine.sampling import SamplingParams, reported_logprobs, sample, sampling_probs
from gyre.traj.audit import audit_micro_batch, audit_warning
from gyre.traj.materialize import materialize, prepare_step
from gyre.traj.record import ExecutionRecord
from gyre.traj.select import SelectionSpec
from gyre.traj.store import CALL_COLUMNS_V1, ShardWriter, pack, read_shard
from gyre.traj.tree import Segment, TrajectoryTree, output_digest
from gyre.train.loss import policy_loss, token_logprobs
from gyre.train.step_stats import merge, summarize


# ---- the engine's rule: draw from the filtered distribution, report SGLang's log-prob ---------

def test_reported_logprob_is_temperature_scaled_and_unfiltered():
    logits = torch.tensor([3.0, 2.5, 1.0, 0.0, -1.0])
    gen = torch.Generator().manual_seed(0)
    for params in (SamplingParams(temperature=0.7, top_p=0.6), SamplingParams(temperature=0.7, top_k=2),
                   SamplingParams(temperature=0.5, min_p=0.3)):
        kept = sampling_probs(logits, params) > 0
        assert 0 < int(kept.sum()) < len(logits)  # the filter acts
        for _ in range(20):
            tok, lp, top = sample(logits, params, gen, top_n=3)
            assert kept[tok]  # drawn inside the filtered set
            assert lp == pytest.approx(float(torch.log_softmax(logits / params.temperature, -1)[tok]))
            assert top[0] == (pytest.approx(float(reported_logprobs(logits, params.temperature).max())), 0)
    # min_p keeps p >= min_p * max(p) (SGLang's rule)
    p = torch.softmax(logits / 0.5, -1)
    assert (sampling_probs(logits, SamplingParams(temperature=0.5, min_p=0.3)) > 0).tolist() == (p >= 0.3 * p.max()).tolist()
    tok, lp, _ = sample(logits, SamplingParams(temperature=0.0), gen)  # greedy: raw log_softmax
    assert tok == 0 and lp == pytest.approx(float(torch.log_softmax(logits, -1)[0]))


# ---- trees with calls at several versions and temperatures ------------------------------------

def two_version_record(eid: str = "mixed") -> ExecutionRecord:
    """An execution whose calls ran at policy versions 0 and 2, temperatures 0.7 and greedy."""
    t = TrajectoryTree()
    sys_seg = Segment("s", [1, 2, 3], "system")
    t.add_call([sys_seg, Segment("u", [4, 5], "user")], "a1", [6], [10, 11, 12], [-0.5, -0.25, -1.0],
               agent_role="main", weight_version="0", policy_version=0,
               sampling={"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05})
    t.add_call([sys_seg, Segment("u", [4, 5], "user"), Segment("a1", [10, 11, 12], "assistant"),
                Segment("u2", [7], "user")], "a2", [6], [13, 14], [-0.125, -2.0],
               agent_role="main", weight_version="2", policy_version=2, sampling={"temperature": 0.0})
    return ExecutionRecord(eid, "task", 0, reward=1.0, tree=t)


def step_of(records, step_version=2):
    return prepare_step(records, SelectionSpec(k=4), step_version=step_version, estimator="reward")


def test_calls_store_sampling_parameters_and_digest_through_a_shard(tmp_path, caplog):
    rec = two_version_record()
    c0, c1 = rec.tree.calls
    assert (c0.temperature, c0.top_p, c0.top_k, c0.min_p) == (0.7, 0.9, 20, 0.05)
    assert (c1.temperature, c1.top_p, c1.top_k, c1.min_p, c1.logprob_temperature) == (0.0, 1.0, -1, 0.0, 1.0)
    assert c0.output_digest == output_digest([10, 11, 12], [-0.5, -0.25, -1.0]) != 0
    w = ShardWriter(tmp_path / "new", identity={"tokenizer": "t", "model": "m"})
    assert read_shard(w.write([rec]))[0].tree.calls == rec.tree.calls  # every field, exactly

    # a schema-1 shard (no sampling columns) reads with the engine's defaults and a warning
    data = pack([rec])
    data["calls"] = rfn.repack_fields(data["calls"][[n for n, _ in CALL_COLUMNS_V1]])
    old = ShardWriter(tmp_path / "old", identity={"tokenizer": "t", "model": "m"}).write_packed(data)
    with h5py.File(old, "r+") as f:
        f.attrs["schema_version"] = 1
    with caplog.at_level(logging.WARNING, logger="gyre.traj.store"):
        calls = read_shard(old)[0].tree.calls
    assert [(c.temperature, c.top_p, c.top_k, c.min_p, c.output_digest) for c in calls] == [(1.0, 1.0, -1, 0.0, 0)] * 2
    assert "schema 1" in caplog.text and "no sampling parameters" in caplog.text


def test_each_token_carries_its_own_lag_and_temperature():
    batch = step_of([two_version_record()])
    assert batch.executions[0].staleness == 2  # the execution's oldest lag: admission's figure
    mat = materialize(batch.executions, layout="tree")
    mb, keys = mat.with_keys(0)
    node_of = {int(n): int(k) for k, n in enumerate(keys[:, 1])}
    tree = batch.executions[0].record.tree
    lag = {n: 2 - tree.nodes[n].policy_version for n in node_of}
    assert sorted(set(lag.values())) == [0, 2]
    assert mb.staleness.tolist() == [lag[int(n)] for n in keys[:, 1]]
    want_t = {0: 0.7, 1: 1.0}  # call 1 was greedy: the engine reported raw log-probs
    assert mb.temperature.tolist() == pytest.approx([want_t[tree.nodes[int(n)].call_index] for n in keys[:, 1]])

    # the loss divides each target's logits by its own temperature
    logits = torch.randn(*mb.input_ids.shape, 32)
    flat = logits.reshape(-1, 32)[mb.pred_pos]
    want = torch.stack([torch.log_softmax(row / t, -1)[tok] for row, t, tok in zip(flat, mb.temperature, mb.target_ids)])
    assert torch.allclose(token_logprobs(logits, mb), want, atol=1e-6)

    # staleness weights and the per-lag mismatch figures follow the tokens' own lags
    mb.old_logprobs = token_logprobs(logits, mb).detach()
    _, stats = policy_loss(logits, mb, staleness_weights=[1.0, 1.0, 0.5])
    n2 = int((mb.staleness == 2).sum())
    assert stats["mm_lag0_n"] == len(keys) - n2 and stats["mm_lag2_n"] == n2 > 0
    assert stats["weight_sum"] == pytest.approx(float(mb.weights[mb.staleness == 0].sum() + 0.5 * mb.weights[mb.staleness == 2].sum()))
    assert set(summarize(merge([stats]))) >= {"mismatch_k3_lag0", "mismatch_k3_lag2"}


# ---- the audit ------------------------------------------------------------------------------

def audit_step(records):
    batch = step_of(records)
    mat = materialize(batch.executions, layout="tree", micro_batch_tokens=64)
    out = []
    for i in range(len(mat)):
        mb, keys = mat.with_keys(i)
        out.append((mb, keys, batch.executions))
    return out


def test_audit_counts_nothing_when_what_trains_is_what_was_sampled():
    parts = audit_step([two_version_record("a"), two_version_record("b")])
    audits = [audit_micro_batch(*p) for p in parts]
    assert sum(a.tokens for a in audits) == 10 and sum(a.mismatched for a in audits) == 0
    assert all(audit_warning(a) is None for a in audits)


def test_audit_names_the_call_whose_stored_output_differs_from_the_engines():
    good, bad = two_version_record("good"), two_version_record("bad")
    leaf = bad.tree.nodes[bad.tree.calls[1].leaf]
    leaf.logprobs = leaf.logprobs.copy()
    leaf.logprobs[0] += 0.25  # the tree no longer holds what the engine returned for call 1
    audits = [audit_micro_batch(*p) for p in audit_step([good, bad])]
    total = sum(a.mismatched for a in audits)
    assert total == 2  # every trained token of that call's node
    first = next(a.first for a in audits if a.first)
    assert first == "execution bad call 1"
    assert "2 of" in audit_warning(next(a for a in audits if a.mismatched)) and "execution bad call 1" in \
        audit_warning(next(a for a in audits if a.mismatched))


def test_audit_counts_single_tokens_a_micro_batch_got_wrong():
    (mb, keys, exe), = audit_step([two_version_record()])
    mb.target_ids[3] += 1
    mb.old_logprobs[1] = float(mb.old_logprobs[1]) - 1e-3
    a = audit_micro_batch(mb, keys, exe)
    assert (a.tokens, a.mismatched) == (5, 2) and a.first.startswith("execution mixed call")


def test_calls_without_a_digest_are_unchecked_not_passed():
    rec = two_version_record()
    for c in rec.tree.calls:
        c.output_digest = 0  # as read from a schema-1 shard
    (mb, keys, exe), = audit_step([rec])
    a = audit_micro_batch(mb, keys, exe)
    assert (a.tokens, a.mismatched, a.unchecked) == (5, 0, 5)
