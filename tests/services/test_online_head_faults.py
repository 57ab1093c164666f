"""The head killed or stopped, then `gyre run --resume`: nothing trained twice, nothing lost.

One run in four jobs carries the three head-fault checks (a job start is most of a test's CPU;
the three used to be six jobs). Each job resumes the one before; the faults are named phases of
gyre/faults.py (a marker file stops a fault from firing twice, so every job runs with every spec):

1. ``head:execution_recorded:3``: SIGKILLed right after its 3rd execution is on disk, before the
   coordinator hears of it;
2. ``head:step_end:1`` (resumed from 1): SIGKILLed at its first step end, after the reduce, before
   step 0 is committed;
3. (resumed from 2) SIGTERM to the head once step 0 is in steps.jsonl: a clean stop, with stopped
   executions left to replay;
4. the resume that finishes the run's 3 steps.

The tests share it through a module-scoped fixture, so this file is one pytest-xdist group
(tests/conftest.py)."""

from __future__ import annotations

import json
import os
import signal
from collections import Counter
from pathlib import Path

import pytest
from support.gyre_run import check_ledger, gyre_run, report, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(2000)]  # the first test waits on four jobs

STEPS, Q, G = 3, 2, 2
SPECS = "head:execution_recorded:3,head:step_end:1"


def executions_in_shards(run_dir: Path) -> set[str]:
    from gyre.traj.store import iter_executions

    return {rec.execution_id for rec in iter_executions(run_dir / "shards")} if (run_dir / "shards").exists() else set()


def workspaces(run_dir: Path) -> set[str]:
    return {p.name for p in (run_dir / "workspaces").iterdir()}


def listed_pids(run_dir: Path) -> list[int]:
    lists = [json.loads(p.read_text()) for p in (run_dir / "pids").glob("cell*.json")]
    return [pid for lst in lists for e in lst.values() for pid, _ in e["pids"]]


def job(run_dir: Path, env: dict, resume: bool):
    return gyre_run(run_dir, "sched.cells=1", f"harness.group_size={G}", steps=STEPS, wait=False, env=env, resume=resume)


def ended(proc, timeout: float = 550) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:  # engines and trainers of a dead job's cells must not outlive it
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return out


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    from gyre.engine.reaper import _running
    from gyre.traj.store import iter_executions

    base = tmp_path_factory.mktemp("headfaults")
    run_dir, faults_dir = base / "h", base / "faults"
    env = {"GYRE_FAULT": SPECS, "GYRE_FAULT_DIR": str(faults_dir)}
    c: dict = {"dir": run_dir, "faults": faults_dir}
    orphans: list[int] = []
    try:
        # 1: killed at its 3rd recorded execution
        proc = job(run_dir, env, resume=False)
        c["out1"], c["rc1"] = ended(proc), proc.returncode
        c["orphans1"] = listed_pids(run_dir)
        orphans += c["orphans1"]
        c["recorded1"] = executions_in_shards(run_dir)
        c["running1"] = workspaces(run_dir) - c["recorded1"]
        # 2: resumed, killed at its first step end
        proc = job(run_dir, env, resume=True)
        c["out2"], c["rc2"] = ended(proc), proc.returncode
        c["orphans1_alive_after2"] = [p for p in c["orphans1"] if _running(p)]
        orphans += listed_pids(run_dir)
        c["state2"] = json.loads((run_dir / "state.json").read_text())
        c["recorded2"] = executions_in_shards(run_dir)
        c["running2"] = workspaces(run_dir) - c["recorded2"] - c["running1"]
        # 3: resumed, SIGTERM to the head once step 0 closed
        steps_file = run_dir / "steps.jsonl"
        c["steps_before3"] = steps_file.read_text().strip() if steps_file.exists() else ""
        proc = job(run_dir, env, resume=True)
        try:
            wait_for(lambda: steps_file.exists() and steps_file.read_text().strip(), 300, "the first step")
            os.kill(int((run_dir / "head.pid").read_text()), signal.SIGTERM)
        finally:
            c["out3"], c["rc3"] = ended(proc, 200), proc.returncode
        c["report3"] = report(run_dir)
        c["stopped3"] = {r.execution_id: len(r.tree.calls) for r in iter_executions(run_dir / "shards")
                         if r.status == "stopped"}
        # 4: resumed to the end
        proc = job(run_dir, env, resume=True)
        c["out4"], c["rc4"] = ended(proc), proc.returncode
        orphans += listed_pids(run_dir)
    finally:
        for pid in orphans:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return c


def finished(c: dict) -> None:
    assert c["rc4"] == 0, c["out4"][-3000:]
    assert report(c["dir"])["version"] == STEPS


def test_head_sigkill_at_execution_recorded_then_resume_loses_nothing_and_reaps_orphans(chain):
    """The head is SIGKILLed right after its 3rd execution is on disk, before the coordinator
    hears of it. The dead job's engines and trainers are listed in run_dir/pids (whatever
    outlives the job is reaped by `--resume`); `gyre run --resume` finishes the run: every recorded
    execution is in the shards once and in the ledger, none `failed` with no calls, nothing lost."""
    from gyre.traj.store import iter_executions

    c, run_dir = chain, chain["dir"]
    assert c["rc1"] != 0, c["out1"][-2000:]
    assert (c["faults"] / "fired-head-execution_recorded-3").exists()
    assert c["orphans1"]  # the killed job's engines and trainers were written down (here mpiexec ended them)
    assert len(c["recorded1"]) >= 3  # durable before the coordinator heard of them
    assert not c["orphans1_alive_after2"]  # reaped by the resume
    finished(c)
    recs = list(iter_executions(run_dir / "shards"))
    ids = Counter(r.execution_id for r in recs)
    assert all(n == 1 for n in ids.values()), ids.most_common(3)  # each execution once
    assert not [r.execution_id for r in recs if r.status in ("failed", "lost") and not r.tree.calls]
    rows = check_ledger(run_dir)
    assert c["recorded1"] <= {r["execution"] for r in rows}
    assert sum(r["admitted"] for r in rows) == STEPS * Q * G  # steps x Q x G, each trained once
    lost = {r["execution"] for r in rows if r["reason"].startswith("lost:")}
    # what was running at each kill is recorded lost, with its reason (the SIGTERM stops, not loses)
    assert lost == c["running1"] | c["running2"], (lost, c["running1"], c["running2"])
    # a lost execution whose calls were journaled is replayed in a new group of its task, once
    for r in resumed_rows(run_dir):
        assert r["from"] in lost or r["from"] in c["stopped3"], r
        assert r["from"] in c["stopped3"] or (r["recorded_calls"] >= 1 and r["replayed_calls"] >= 1), r


def test_head_fault_phase_step_end_resume(chain):
    """The head is SIGKILLed at its first step end (after the reduce, before the step is
    committed); `gyre run --resume` finishes the run: nothing trained twice, nothing lost."""
    c, run_dir = chain, chain["dir"]
    assert c["rc2"] != 0, c["out2"][-2000:]
    assert (c["faults"] / "fired-head-step_end-1").exists()
    assert c["state2"]["version"] == 0 and not c["steps_before3"]  # step 0 never committed
    finished(c)
    steps = [json.loads(s)["step"] for s in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert sorted(steps) == list(range(STEPS))
    rows = check_ledger(run_dir)
    assert sum(r["admitted"] for r in rows) == STEPS * Q * G  # each trained once
    assert c["recorded2"] <= {r["execution"] for r in rows}  # what the killed head recorded is accounted for
    assert all(not r["admitted"] for r in rows if r["execution"] in c["recorded2"])


def test_sigterm_to_head_then_resume_trains_nothing_twice(chain):
    c, run_dir = chain, chain["dir"]
    out = c["out3"]
    assert c["rc3"] != 0, out[-2000:]
    assert "gyre: run cancelled at step" in out and "resume with: gyre run --resume" in out, out[-2000:]
    first = c["report3"]
    assert first["stopped"] and 1 <= first["version"] < STEPS
    finished(c)
    steps = [json.loads(s)["step"] for s in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert sorted(steps) == list(range(STEPS))  # each step once, across the jobs
    check_ledger(run_dir)
    # replay-resume: a stopped execution with calls continues in a new group of its task
    resumed = resumed_rows(run_dir)
    assert len({r["from"] for r in resumed}) == len(resumed)  # each stopped execution resumed at most once
    stopped = c["stopped3"]
    # (a resumed row not from a stopped one is from an execution the SIGKILLs lost: the other test)
    resumed = [r for r in resumed if r["from"] in stopped]
    for r in resumed:
        assert r["recorded_calls"] == stopped[r["from"]] and r["replayed_calls"] >= 1, r
    assert resumed or not any(stopped.values()), (stopped, resumed)


def resumed_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines() if '"resumed"' in line]
