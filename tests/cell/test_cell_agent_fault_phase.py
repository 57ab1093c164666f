"""Deaths at named phases of a cell (gyre.faults): the run still trains every step once.

The test is one run in two `gyre run` jobs (1 head + 2 cells, scheme C so that both cells train
and reduce together; the second job resumes the first) with ``GYRE_FAULT=<process>:<phase>[,...]``: the first process that reaches a phase
SIGKILLs itself there, once (a marker file in ``GYRE_FAULT_DIR`` proves it fired and stops a restarted
process from dying again). Nothing waits on a sleep: the kill happens exactly at the phase.

Checked: the fault fired; every step closed exactly once (steps.jsonl) and the run reached its
last version; ledger.jsonl trains each execution at most once and records every other ended
execution with a reason; the right recovery ran (a trainer restart, and for deaths between the
sum and the commit a repeated reduce).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.gyre_run import check_ledger, gyre_run, report  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# the smallest run in which both cells train and reduce together at every step (test_online's
# SMALL run: 2 groups of 4, so a step nearly always has micro-batches for both cells)
TINY = ["sched.cells=2", "sched.scheme=C", "sched.staleness=0", "train.micro_batch_tokens=256"]


def faulted_run(tmp_path: Path, spec: str, *over: str, steps: int = 2, resume: bool = False):
    run_dir = tmp_path / "run"
    env_before = {k: os.environ.get(k) for k in ("GYRE_FAULT", "GYRE_FAULT_DIR")}
    os.environ["GYRE_FAULT"], os.environ["GYRE_FAULT_DIR"] = spec, str(tmp_path)
    try:
        rc, out = gyre_run(run_dir, *TINY, *over, steps=steps, resume=resume)
    finally:
        for k, v in env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return run_dir, rc, out


def steps_closed(run_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run_dir / "steps.jsonl").read_text().splitlines() if x.strip()]


def assert_recovered(tmp_path: Path, run_dir: Path, rc: int, out: str, faults: list[tuple[str, str]]) -> dict:
    for process, phase in faults:
        assert (tmp_path / f"fired-{process}-{phase}-1").exists(), f"the fault {process}:{phase} never fired\n{out[-3000:]}"
    assert rc == 0, out[-4000:]
    rep = report(run_dir)
    assert rep["version"] == 2 and not rep["errors"], rep["errors"]
    assert sorted(steps_closed(run_dir)) == [0, 1]  # each step closed once
    check_ledger(run_dir)
    # colocate's cell stats: the whole pool moves together, and time adds up per cell
    assert rep["label"].startswith("C") and len({c["switches"] for c in rep["cells"]}) == 1, rep["cells"]
    assert {"rollout_s", "train_s", "switching_s", "idle_s", "utilisation"} <= set(rep["cells"][0])
    return rep


# The run chains its phases: every spec kills once (its marker stops a restarted process from
# dying there again), so the first trainer to reach phase 1 dies, the run recovers, the first to
# reach phase 2 dies, and so on. One run for every trainer phase (each run costs most of a minute
# of make test); a phase whose recovery breaks still fails the run, and the fired markers say which
# phases were reached.
BEFORE_THE_SUM = ["micro_batch", "prepare_reduce"]  # recovery: the lost micro-batches handed out again
BEFORE_THE_COMMIT = ["reduce", "optimizer_step", "export", "checkpoint"]  # recovery: the reduce repeated


def test_agent_fault_phase_command_resumes_then_trainer_fault_phases_before_the_sum_the_commit_and_a_later_update(
        tmp_path):
    """One run in two jobs carries both checks (a job start is most of a test's CPU).

    First job: an agent dies at its 3rd command; an agent is an MPI rank, so the job ends, and
    `gyre run --resume` resumes from the last checkpoint.

    Second job (the resume): train.minibatches_per_step = 2, so each step is two reduces: a
    trainer dies at each phase before an update's sum (its micro-batches are handed out again)
    and before its commit (the reduce is repeated), then one dies on its first micro-batch of a
    second update (the first is applied: its replacement loads the checkpoint inside the step)."""
    phases = BEFORE_THE_SUM + BEFORE_THE_COMMIT + ["later_minibatch"]
    over = ("train.minibatches_per_step=2", "train.off_policy=decoupled")
    run_dir, rc, out = faulted_run(tmp_path, "agent:command:3", *over)
    assert (tmp_path / "fired-agent-command-3").exists(), out[-3000:]
    assert rc != 0  # an agent is an MPI rank: its death ends the job
    assert not any((tmp_path / f"fired-trainer-{p}-1").exists() for p in phases)  # (none asked for yet)
    cells = json.loads((run_dir / "cells.json").read_text())["cells"] if (run_dir / "cells.json").exists() else []
    for c in cells:  # the dead agent's engine ran in its own session: end it
        if c.get("engine_pid"):
            try:
                os.kill(c["engine_pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
    # the resume: each step once across the two jobs, every trainer phase fired and recovered
    spec = ",".join(["agent:command:3", *(f"trainer:{p}" for p in phases)])
    run_dir, rc, out = faulted_run(tmp_path, spec, *over, resume=True)
    rep = assert_recovered(tmp_path, run_dir, rc, out, [("trainer", p) for p in phases])
    restarts = [e for e in rep["events"] if e["kind"] == "trainer_restarted"]
    assert len(restarts) >= len(phases), restarts
    assert any(r["info"]["lost"] for r in restarts), restarts  # gradients were handed out again
    retries = [e for e in rep["events"] if e["kind"] == "reduce_retry"]
    assert len(retries) >= len(BEFORE_THE_COMMIT), "a death before the commit did not repeat the reduce"
    rows = [json.loads(x) for x in (run_dir / "steps.jsonl").read_text().splitlines() if x.strip()]
    assert [r["minibatches"] for r in rows] == [2, 2] and all(len(r["minibatch_grad_norms"]) == 2 for r in rows)
    assert all(r["clip_frac"] is not None for r in rows) and max(r["clip_frac"] for r in rows) > 0  # the clip acts
    # the weights of the last version are complete (a death in export left no half directory), and
    # an update inside a step exports nothing
    assert (run_dir / "weights" / "v2" / "config.json").exists() and not (run_dir / "weights" / "v0u1").exists()
