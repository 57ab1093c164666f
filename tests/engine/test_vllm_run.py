"""The whole online loop on a real vLLM: `gyre run` with engine.backend = "vllm" (2 cells, the
elastic E scheme, each cell switching rollout -> train -> rollout), every call served by vLLM's CPU
server, weights pushed to it, and the token truth of every step: the audit finds 0 differences and
the trainer's log-probs at lag 0 match vLLM's. One job carries all of it (a vLLM start is ~40 s of
CPU per cell)."""

from __future__ import annotations

import json

import pytest
from support.gyre_run import check_ledger, gyre_run, report

from gyre.config import load_config
from gyre.engine.backends.vllm import vllm_python
from gyre.model.tiny import SERVING_HEAD_DIM, ensure_tiny_model
from gyre.traj.store import iter_executions

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_gyre_run_on_vllm_switches_both_ways_trains_and_keeps_token_truth(tmp_path):
    if not vllm_python(load_config(None, ["engine.backend=vllm"])).exists():
        pytest.skip("no vLLM environment: run `make install-vllm`")
    model = ensure_tiny_model(tmp_path / "tiny-qwen-hd32", head_dim=SERVING_HEAD_DIM)
    run = tmp_path / "v"
    rc, out = gyre_run(run, "engine.backend=vllm", f"model.path={model}", "sched.scheme=E-paper",
                       "sched.execs_per_cell=4", "run.keep_checkpoints=1", timeout=900)
    assert rc == 0, out[-3000:]
    rep = report(run)
    assert len(rep["steps"]) == 2 and rep["version"] == 2, out[-3000:]
    assert rep["harness_errors"] == 0 and set(rep["executions"]) == {"done"} and not rep["errors"]
    for c in range(2):  # both cells served with vLLM
        assert json.loads((run / "cells" / f"cell{c}.json").read_text())["engine_backend"] == "vllm"
    for step in rep["steps"]:
        assert step["grad_norm"] is not None and step["grad_norm"] > 0
        assert step["audit_tokens"] > 0 and step["audit_mismatched_tokens"] == 0, step  # token identity
        assert step["mismatch_tokens_lag0"] > 0 and step["mismatch_k3_lag0"] < 1e-5, step  # lag-0 log-probs
    roles = [[r for r, a, b in rep["intervals"][str(c)] if b > a] for c in range(2)]
    back = [i for i, rs in enumerate(roles) if "train" in rs and "rollout" in rs[rs.index("train"):]]
    assert back, roles  # rollout -> train and train -> rollout on vLLM (pause, weight reload, resume)
    rows = check_ledger(run)
    assert sum(r["admitted"] for r in rows) == 2 * 2 * 4
    # every call records the weight version vLLM reported for it: step 1 on "0", step 2 on the
    # trainer's version 1, pushed to vLLM from its export (pause, reload, resume)
    calls = [c for r in iter_executions(run / "shards") for c in r.tree.calls]
    assert {c.weight_version for c in calls} == {"0", "1"}
    assert all(c.weight_version == str(c.policy_version) for c in calls)
    assert (run / "weights" / "v2" / "model.safetensors").exists()
