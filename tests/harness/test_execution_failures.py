"""Failures one at a time (the rollout service's execution life cycle, gyre.services.rollout): an execution whose sandbox or process could not
start is retried alone, in a fresh workspace, a bounded number of times; one that never gets to
run is `lost` (never scored as a real 0); a reused id is `lost`, never scored from the current
directory. Real harness processes, the real proxy object and the real evaluator."""

from __future__ import annotations

import asyncio
import math
import os
import warnings
from pathlib import Path

from gyre.config import GyreConfig
from gyre.engine.router import Router
from gyre.harness.evaluator import EvalOptions, EvaluatorPool
from gyre.harness.runner import HarnessPool
from gyre.harness.sandbox import Environments, SandboxConfig
from gyre.harness.tasks import load_suite
from gyre.model.tokenizer import load_tokenizer
from gyre.proxy.server import Proxy
from gyre.services.rollout import RolloutService
from gyre.traj.record import FINISHED
from gyre.traj.store import iter_executions

ASSETS = Path(__file__).resolve().parents[2] / "gyre" / "assets"
TASK = {t.name: t for t in load_suite("builtin")}["fizzbuzz"]
SOLVE = "#!/bin/sh\nprintf 'def fizzbuzz(n):\\n    return %s\\n' \"'x'\" > fizzbuzz.py\n"


def run(tmp_path: Path, eid: str, retries: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        envs = Environments(SandboxConfig(sandbox="none"))
    # argv[0] names the execution: only the binaries created below exist, so a try "cannot start"
    pool = HarnessPool(tmp_path / "run", [str(tmp_path / "bin" / "{execution_id}")], environments=envs)
    evaluators = EvaluatorPool(EvalOptions(timeout_s=60, scratch_dir=str(tmp_path / "scratch")), workers=1,
                               workspaces_root=tmp_path / "run" / "workspaces")

    cfg = GyreConfig()
    cfg.harness.infra_retries = retries
    service = RolloutService(cfg, envs, ASSETS, {"model_hash": "m" * 8, "tokenizer_hash": "t" * 8}, tmp_path / "shards")
    service.pool, service.evaluators, service.base_url = pool, evaluators, "http://127.0.0.1:9/v1"

    async def main():
        service.proxy = Proxy(Router([]), load_tokenizer(ASSETS))
        try:
            rec = await service.execute(TASK, eid, 0)
            assert rec.execution_id in {r.execution_id for r in iter_executions(tmp_path / "shards")}  # durable
            return rec
        finally:
            await service.proxy.router.close()
    try:
        return asyncio.run(main())
    finally:
        evaluators.shutdown()


def harness(tmp_path: Path, name: str) -> None:
    b = tmp_path / "bin" / name
    b.parent.mkdir(parents=True, exist_ok=True)
    b.write_text(SOLVE)
    os.chmod(b, 0o755)


def test_a_harness_that_cannot_start_is_retried_alone_in_a_fresh_workspace(tmp_path):
    harness(tmp_path, "fizzbuzz-g0-a0.retry2")  # the first two tries cannot start, the third runs
    rec = run(tmp_path, "fizzbuzz-g0-a0", retries=2)
    ws = tmp_path / "run" / "workspaces"
    assert rec.status == "done" and rec.execution_id == "fizzbuzz-g0-a0"
    assert Path(rec.workspace) == (ws / "fizzbuzz-g0-a0.retry2").absolute()  # never a used path
    assert sorted(p.name for p in ws.iterdir()) == ["fizzbuzz-g0-a0", "fizzbuzz-g0-a0.retry1", "fizzbuzz-g0-a0.retry2"]
    assert rec.reward_source == "tests" and math.isfinite(rec.reward)  # scored: its own (retry) workspace


def test_an_execution_that_never_starts_is_lost_not_a_scored_zero(tmp_path):
    rec = run(tmp_path, "fizzbuzz-g1-a0", retries=1)
    assert rec.status == "lost" and rec.status not in FINISHED
    assert math.isnan(rec.reward) and rec.reward_source.startswith("not-evaluated: lost")
    assert "tried 2 times" in rec.reward_source
    assert not (tmp_path / "scratch").exists() or not any((tmp_path / "scratch").iterdir())


def test_a_reused_id_is_lost_and_the_current_directory_is_never_scored(tmp_path, monkeypatch):
    harness(tmp_path, "fizzbuzz-g2-a0")
    first = run(tmp_path, "fizzbuzz-g2-a0", retries=0)
    assert first.status == "done"
    monkeypatch.chdir(Path(first.workspace))  # a directory holding a solution, as in the issue
    again = run(tmp_path, "fizzbuzz-g2-a0", retries=0)  # its workspace exists: the path is never reused
    assert again.status == "lost" and "WorkspaceExists" in again.reward_source
    assert math.isnan(again.reward) and not again.workspace
