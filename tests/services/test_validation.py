"""Validation rounds (gyre/services/validation.py): pass@k, held-out executions through the real
rollout service (engines, proxy, harnesses, evaluator) that never train, results that survive a stop."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
from pathlib import Path

import pytest

from gyre.config import ConfigError, load_config
from gyre.offline_rollout import validate
from gyre.services.validation import ValidationLog, pass_at_k, summarize, validation_tasks
from gyre.traj.store import iter_executions

ROOT = Path(__file__).resolve().parents[2]


def brute_pass_at_k(n: int, c: int, k: int) -> float:
    """Over every k-subset of n samples (c correct): the share holding at least one correct."""
    outcomes = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n,c,k", [(4, 0, 1), (4, 1, 1), (4, 1, 2), (5, 2, 3), (6, 5, 2), (8, 3, 8), (3, 3, 1)])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k))
    with pytest.raises(ValueError):
        pass_at_k(n, c, n + 1)


def test_summarize_per_task_and_overall():
    rows = [{"task": "a", "reward": r, "parts": {"tests": r, "bonus": 0.1}, "version": 2} for r in (1.0, 0.0, 1.0, 0.5)]
    rows += [{"task": "b", "reward": r, "parts": {}, "version": 2} for r in (0.0, 0.0, None, 0.0)]
    s = summarize("v2", 2, rows, 4, 2, 1.0)
    assert s["per_task"]["a"]["pass@1"] == 0.5 and s["per_task"]["a"]["pass@2"] == pytest.approx(1 - 1 / 6)
    assert s["per_task"]["b"]["pass@1"] == 0.0 and s["per_task"]["b"]["reward_mean"] == 0.0
    assert s["pass@1"] == 0.25 and s["pass@k"] == pytest.approx((1 - 1 / 6) / 2)
    assert s["reward_mean"] == pytest.approx(2.5 / 7) and s["unscored"] == 1  # None is not a 0
    assert s["parts"] == {"bonus": pytest.approx(0.1), "tests": pytest.approx(0.625)}


def test_no_held_out_tasks_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="validation has no task"):
        validation_tasks(load_config(None, [f"run.dir={tmp_path}"]))
    with pytest.raises(ConfigError, match="validate.tasks"):
        validation_tasks(load_config(None, ["validate.suite=learnable", 'validate.tasks=["nope"]']))
    with pytest.raises(ConfigError, match="validate.k = 5 is more than validate.samples = 4"):
        load_config(None, ["validate.k=5"])


def test_due_rounds_and_a_finished_round_is_not_redone(tmp_path):
    from types import SimpleNamespace

    from gyre.services.validation import ValidationSpec, Validator

    cfg = load_config(None, [f"run.dir={tmp_path}", "validate.every_steps=2", "validate.suite=learnable"])
    spec = ValidationSpec.from_config(cfg)
    (tmp_path / "validation.jsonl").write_text(json.dumps({"kind": "round", "round": "v4", "version": 4}) + "\n"
                                               + "{cut short by a kill\n")
    v = Validator(spec, SimpleNamespace(cfg=cfg), tmp_path, identity={"model_hash": "m", "tokenizer_hash": "t"})
    assert [n for n in range(9) if v.due(n, 0)] == [0, 2, 6, 8]  # v4 finished before a preemption
    assert [n for n in range(3, 9) if v.due(n, 3)] == [3, 6, 8]  # a resumed run validates where it starts
    spec.at_start = False
    assert not v.due(0, 0) and v.due(2, 0)
    assert v.views() == () and not v.busy_at(2, 0)


def _cfg(run_dir: Path, *extra: str):
    return load_config(ROOT / "launchers" / "demo.toml",
                       [f"run.dir={run_dir}", "engine.endpoints=1", "validate.suite=learnable", "validate.samples=3",
                        "validate.k=2", "validate.pass_threshold=0.2", "validate.temperature=0.5",
                        "validate.top_p=0.9", "harness.concurrency=8", *extra])


@pytest.mark.e2e
@pytest.mark.slow
def test_a_round_runs_through_the_rollout_service_never_into_training_and_is_not_redone(tmp_path):
    run = tmp_path / "run"
    lines = []
    first = asyncio.run(validate(_cfg(run), say=lines.append))
    assert first["round"] == "v0" and first["tasks"] == 2 and first["executions"] == 6
    assert lines and lines[0].startswith("gyre: validation v0: pass@1 ")
    log = ValidationLog(run)
    execs = log.done["v0"]
    assert len(execs) == 6 and {e["task"] for e in execs} == {"short_answer", "no_letters"}
    passed = {t: sum(e["reward"] >= 0.2 for e in execs if e["task"] == t) for t in ("short_answer", "no_letters")}
    for task, c in passed.items():
        assert first["per_task"][task]["pass@1"] == pytest.approx(c / 3)
        assert first["per_task"][task]["pass@2"] == pytest.approx(pass_at_k(3, c, 2))
    # its records are in the validation shards only, every call sampled with validate's parameters
    recs = list(iter_executions(run / "validation" / "shards"))
    assert sorted(r.execution_id for r in recs) == sorted(e["execution"] for e in execs)
    assert not (run / "shards").exists() or not list(iter_executions(run / "shards"))
    assert {(c.temperature, c.top_p) for r in recs for c in r.tree.calls} == {(0.5, 0.9)}
    # again: finished, so nothing runs (no new workspace)
    before = sorted(p.name for p in (run / "workspaces").iterdir())
    assert asyncio.run(validate(_cfg(run), say=lines.append)) == first
    assert sorted(p.name for p in (run / "workspaces").iterdir()) == before
    # a round a stop cut short keeps what finished: drop the round line and two samples, run again
    kept = [x for x in (run / "validation.jsonl").read_text().splitlines()
            if json.loads(x)["kind"] == "execution"][:4]
    (run / "validation.jsonl").write_text("\n".join(kept) + "\n")
    again = asyncio.run(validate(_cfg(run), say=lines.append))
    after = sorted(p.name for p in (run / "workspaces").iterdir())
    assert len(after) == len(before) + 2  # only the two missing samples ran, in fresh workspaces
    assert again["executions"] == 6 and len(ValidationLog(run).done["v0"]) == 6


@pytest.mark.e2e
@pytest.mark.slow
def test_gyre_rollout_validates_on_its_own_engines(tmp_path):
    from gyre.offline_rollout import Rollout

    cfg = _cfg(tmp_path / "run", "harness.suite=learnable", 'harness.tasks=["short_answer"]', "harness.group_size=2",
               "validate.samples=2", 'validate.tasks=["no_letters"]')
    summary = asyncio.run(Rollout(cfg, progress=False, validate=True).run())
    assert summary.executions == {"done": 2}
    assert summary.validation["round"] == "v0" and summary.validation["executions"] == 2
    assert {r.task for r in iter_executions(tmp_path / "run" / "shards")} == {"short_answer"}
    assert {r.task for r in iter_executions(tmp_path / "run" / "validation" / "shards")} == {"no_letters"}


# `gyre run`'s rounds (at the start, every step, the end, with a reward function) and a resumed run
# not redoing them: tests/services/test_online_resume.py, on the one run in three sessions there.
