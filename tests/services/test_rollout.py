"""`gyre rollout` end to end: real engine subprocesses, the proxy, harness subprocesses, the
evaluator and HDF5 shards, on the builtin suite."""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gyre.traj.record import FINISHED
from gyre.offline_rollout import Rollout
from gyre.traj.store import iter_executions
from support.rollout_config import AGENT, cfg_for


def records(run_dir: Path):
    return list(iter_executions(run_dir / "shards"))


def test_hanging_and_crashing_harnesses_are_recorded_and_scored(tmp_path):
    sleeper = cfg_for(tmp_path / "a", "harness.timeout_s=1.5", "harness.kill_grace_s=0.5",
                      command=["bash", "-c", "echo 'def fizzbuzz(n): pass' > fizzbuzz.py; sleep 1000"])
    asyncio.run(Rollout(sleeper, progress=False).run())
    recs = records(tmp_path / "a")
    assert {r.status for r in recs} == {"timeout"}
    assert {r.reward_source for r in recs} == {"tests-after-timeout"}
    assert all(math.isfinite(r.reward) for r in recs)
    crasher = cfg_for(tmp_path / "b", command=["bash", "-c", "touch partial.py; kill -SEGV $$"])
    summary = asyncio.run(Rollout(crasher, progress=False).run())
    recs = records(tmp_path / "b")
    assert {r.status for r in recs} == {"crashed"}
    assert {r.reward_source for r in recs} == {"tests-after-crash"}
    # the summary tells them as harness failures, not as rewards of 0 (the official score counts them 0)
    assert summary.harness_failures == len(recs) and summary.rewards == [] and summary.official == [0.0] * len(recs)


@pytest.mark.slow
def test_a_limit_s_error_is_recorded_in_the_shard_and_counted_in_the_summary(tmp_path):
    hoarder = cfg_for(tmp_path / "run", "harness.max_workspace_files=50", "harness.limits_poll_s=0.1",
                      "engine.endpoints=1", 'harness.tasks=["fizzbuzz"]', command=["bash", "-c", "mkdir d; touch d/f{1..200}; sleep 1000"])
    summary = asyncio.run(Rollout(hoarder, progress=False).run())
    recs = records(tmp_path / "run")
    assert len(recs) == 2 and {r.status for r in recs} == {"failed"}
    assert all(r.error.startswith("harness.max_workspace_files = 50 passed: the workspace holds more than 50")
               for r in recs), [r.error for r in recs]
    assert summary.limits == {"max_workspace_files": 2}


def test_endpoint_removed_mid_rollout_fails_no_execution_and_trees_are_branching_and_evaluated(tmp_path):
    """One rollout carries two checks (its start is most of its CPU): an endpoint removed while it
    serves executions fails none of them (its calls go elsewhere), and each execution is recorded
    as an evaluated branching tree (sub-agent and compaction branches), its workspace and logs
    under run.dir."""
    ro = Rollout(cfg_for(tmp_path / "run", "harness.group_size=3", "harness.concurrency=6"), progress=False)

    async def main():
        task = asyncio.create_task(ro.run())
        await ro.started.wait()
        while ro.proxy.calls_total < 4:
            await asyncio.sleep(0.05)
        used = [c.endpoint for s in ro.proxy.by_id.values() for c in s.tree.calls]
        victim = max(set(used), key=used.count)  # an endpoint that is serving executions
        t_removed = time.time()
        await ro.router.remove_endpoint(victim, abort=True)
        return victim, t_removed, await task

    victim, t_removed, summary = asyncio.run(main())
    recs = records(tmp_path / "run")
    assert summary.executions == {"done": 6} and len(recs) == 6  # no execution failed
    calls = [c for r in recs for c in r.tree.calls]
    assert any(c.endpoint == victim for c in calls)
    late = [c for c in calls if c.t_end > t_removed + 0.5]
    assert late and all(c.endpoint != victim for c in late)
    assert all(c.finish_reason != "abort" for c in calls)
    # evaluated branching trees
    for rec in recs:
        roles = {c.agent_role for c in rec.tree.calls}
        assert {"main", "subagent:explorer", "compactor"} <= roles, roles
        st = rec.tree.stats()
        assert st.leaves >= 3 and st.expanded_nodes > st.unique_nodes  # sub-agent + compaction branches
        assert math.isfinite(rec.reward) and rec.reward_source == "tests" and rec.total > 0
        for call in rec.tree.calls:  # every call's recorded input really is a prefix path of the tree
            assert len(rec.tree.call_input_ids(call)) == call.n_input
    assert os.stat(tmp_path / "run").st_mode & 0o077 == 0
    assert {p.name for p in (tmp_path / "run" / "workspaces").iterdir()} == {r.execution_id for r in recs}
    for rec in recs:  # the evaluator's log lies under run.dir, beside the harness's (issue 24)
        assert "passed" in (tmp_path / "run" / "logs" / rec.execution_id / "evaluation.log").read_text()


GATE_AGENT = Path(__file__).resolve().parents[1] / "harness_scripts" / "gate_agent.py"


def test_sigterm_then_resume_runs_only_the_rest_and_replays_the_stopped(tmp_path):
    """The roman executions wait mid-run behind a gate (tests/harness_scripts/gate_agent.py: their
    calls made and recorded) while the fizzbuzz ones finish and are recorded; then SIGTERM. The
    resume runs only the roman ones, each replaying its recorded calls in a fresh workspace."""
    run_dir, gate = tmp_path / "run", tmp_path / "gate"
    agent = ["{python}", str(GATE_AGENT), "{execution_id}", *AGENT[3:]]  # the reference agent's own arguments
    cmd = "[" + ", ".join(f'"{c}"' for c in agent) + "]"
    # the gate agent coordinates through a folder outside its execution: what a sandbox hides
    args = [sys.executable, "-m", "gyre.cli", "rollout", "--no-progress", f"run.dir={run_dir}", "engine.endpoints=1",
            "harness.group_size=2", "harness.concurrency=4", 'harness.tasks=["fizzbuzz", "roman"]',
            f"harness.command={cmd}", "store.executions_per_shard=1", "harness.sandbox=none",
            f'harness.env=["GYRE_GATE_PREFIX=roman-", "GYRE_GATE_DIR={gate}"]']
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def both_fizzbuzz_recorded_and_both_roman_waiting() -> bool:
        return len(list(run_dir.glob("shards/*.h5"))) >= 2 and len(list(gate.glob("roman-*"))) == 2

    deadline = time.monotonic() + 240  # a state that lasts until the SIGTERM, looked for every 0.2 s
    while time.monotonic() < deadline and proc.poll() is None and not both_fizzbuzz_recorded_and_both_roman_waiting():
        time.sleep(0.2)
    assert proc.poll() is None and both_fizzbuzz_recorded_and_both_roman_waiting(), proc.poll()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    first = records(run_dir)
    done_first = {r.execution_id for r in first if r.status in FINISHED}
    stopped = [r for r in first if r.status == "stopped"]
    assert done_first and stopped, [(r.execution_id, r.status) for r in first]
    assert all(r.reward_source.startswith("not-evaluated") for r in stopped)
    assert sorted(r.execution_id.split("-")[0] for r in stopped) == ["roman", "roman"]
    (gate / "open").touch()
    again = subprocess.run(args + ["--resume"], capture_output=True, text=True, timeout=400)
    assert again.returncode == 0, again.stdout + again.stderr
    final = records(run_dir)
    finished = [r for r in final if r.status in FINISHED]
    bases = [r.execution_id.rsplit("-a", 1)[0] for r in finished]
    assert sorted(bases) == sorted({f"{t}-g{g}" for t in ("fizzbuzz", "roman") for g in range(2)})  # each once
    assert done_first <= {r.execution_id for r in finished}  # nothing finished was rerun
    assert len(final) == len(first) + (len(finished) - len(done_first))
    # replay-resume: a stopped execution's recorded calls are answered again, token for token
    by_base = {r.execution_id.rsplit("-a", 1)[0]: r for r in finished}
    replayed = 0
    for old in (r for r in stopped if r.tree.calls):
        new = by_base[old.execution_id.rsplit("-a", 1)[0]]
        hits = [c for c in new.tree.calls if c.endpoint == "replay"]
        assert len(hits) == len(old.tree.calls), (old.execution_id, len(hits), len(old.tree.calls))
        for a, b in zip(old.tree.calls, hits):
            assert (a.weight_version, a.agent_role) == (b.weight_version, b.agent_role)
            assert list(old.tree.call_output_ids(a)) == list(new.tree.call_output_ids(b))
        replayed += len(hits)
        assert new.workspace != old.workspace  # a fresh workspace, never the stopped one's path
    assert replayed > 0, "no stopped execution had recorded calls: stop later"
    assert f"({replayed} calls replayed" in again.stdout


MINI = shutil.which("mini", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")


@pytest.mark.skipif(MINI is None, reason="mini-swe-agent is a dev dependency (make install)")
def test_mini_swe_agent_runs_unmodified_through_the_proxy(tmp_path):
    mini = [MINI, "-m", "openai/main", "-t", "{prompt}", "-y", "--exit-immediately", "-o", "{workspace}/traj.json",
            "-c", "mini.yaml", "-c", "model.model_kwargs.api_base={base_url}", "-c", "agent.step_limit=3",
            "-c", "agent.cost_limit=0", "-c", "model.model_kwargs.max_tokens=24"]
    cfg = cfg_for(tmp_path / "run", "harness.group_size=1", 'harness.tasks=["fizzbuzz"]',
                  'harness.env=["MSWEA_CONFIGURED=true", "MSWEA_COST_TRACKING=ignore_errors"]', command=mini)
    asyncio.run(Rollout(cfg, progress=False).run())
    (rec,) = records(tmp_path / "run")
    assert len(rec.tree.calls) >= 2, rec
    assert {c.agent_role for c in rec.tree.calls} == {"main"}
    assert rec.tree.stats().leaves >= 1 and math.isfinite(rec.reward)


def _alive(pid: int) -> bool:
    from gyre.engine.reaper import _running

    return _running(pid)


@pytest.mark.slow
def test_sigkill_of_rollout_at_each_named_phase_then_resume_runs_every_execution_once(tmp_path):
    """`gyre rollout` SIGKILLed at its 2nd execution's end before that execution is on disk
    (execution_ended), then `--resume` SIGKILLed at its own 2nd execution's end after it is on disk
    (execution_recorded), then `--resume` again (one chain: a rollout's start is most of its CPU):
    what was recorded is kept, the rest reruns in fresh workspaces, every (task, member) finishes
    exactly once, nothing is `failed` or `lost` without cause, and the engines and key files each
    killed run left behind are reaped by the next."""
    import json

    run_dir = tmp_path / "run"
    cmd = "[" + ", ".join(f'"{c}"' for c in AGENT) + "]"
    args = [sys.executable, "-m", "gyre.cli", "rollout", "--no-progress", f"run.dir={run_dir}", "engine.endpoints=1",
            "harness.group_size=2", "harness.concurrency=2", 'harness.tasks=["fizzbuzz", "roman"]',
            f"harness.command={cmd}"]
    # a fault fires once (its marker): the first run dies at the first spec (an execution ends
    # before it is recorded), the first resume at the second, the second resume runs to the end
    env = {**os.environ, "GYRE_FAULT": "rollout:execution_ended:2,rollout:execution_recorded:2",
           "GYRE_FAULT_DIR": str(tmp_path / "faults")}

    def killed_run(resume: bool, kept_before: set[str]) -> tuple[list[int], list[str], set[str]]:
        run = subprocess.run(args + ["--resume"] * resume, capture_output=True, text=True, timeout=400, env=env)
        assert run.returncode == -signal.SIGKILL, run.stdout + run.stderr
        left = json.loads((run_dir / "pids" / "rollout.json").read_text())
        orphans = [pid for e in left.values() for pid, _ in e["pids"]]
        keys = [e["key_file"] for e in left.values() if e["key_file"]]
        assert orphans and all(_alive(p) for p in orphans)  # what SIGKILL leaves behind
        assert keys and all(Path(k).exists() for k in keys)
        kept = {r.execution_id for r in records(run_dir)}
        assert kept_before <= kept
        return orphans, keys, kept

    orphans, keys, kept = killed_run(False, set())
    assert (tmp_path / "faults" / "fired-rollout-execution_ended-2").exists()
    assert len(kept) == 1  # the 2nd execution ended but was not on disk: not kept
    orphans2, keys2, kept2 = killed_run(True, kept)
    assert (tmp_path / "faults" / "fired-rollout-execution_recorded-2").exists()
    assert len(kept2) == len(kept) + 2  # durable before acknowledged: the 2nd one of this run is on disk
    assert not any(_alive(p) for p in orphans) and not any(Path(k).exists() for k in keys)  # reaped by the resume
    again = subprocess.run(args + ["--resume"], capture_output=True, text=True, timeout=400, env=env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert not any(_alive(p) for p in orphans2) and not any(Path(k).exists() for k in keys2)
    assert not list((run_dir / "pids").glob("*.json"))  # the lists go with what they listed
    final = records(run_dir)
    assert kept2 <= {r.execution_id for r in final}
    assert sorted(r.execution_id.rsplit("-a", 1)[0] for r in final) == \
        sorted(f"{t}-g{g}" for t in ("fizzbuzz", "roman") for g in range(2))  # every execution once
    for r in final:
        assert r.status == "done" and r.tree.calls, (r.execution_id, r.status, r.reward_source)
        assert Path(r.workspace) == (run_dir / "workspaces" / r.execution_id).absolute()
        assert math.isfinite(r.reward) and r.reward_source == "tests"
    killed = {p.name for p in (run_dir / "workspaces").iterdir()} - {r.execution_id for r in final}
    assert killed  # the executions the kills interrupted kept their workspaces; reruns got new ones


@pytest.mark.slow
def test_sigkill_mid_execution_then_resume_replays_each_running_execution_from_its_journal(tmp_path):
    """Issue 34: executions running when the process was killed were rerun from scratch. Now each
    recorded call is journaled before its answer goes out; `--resume` replays a killed execution's
    journal into its restarted harness (no engine time), then goes live; each execution is
    recorded once and the journals go once their executions are in shards."""
    from gyre.proxy.journal import read_journal
    from gyre.proxy.replay import replayed_calls

    run_dir = tmp_path / "run"
    cmd = "[" + ", ".join(f'"{c}"' for c in AGENT) + "]"
    args = [sys.executable, "-m", "gyre.cli", "rollout", "--no-progress", f"run.dir={run_dir}", "engine.endpoints=1",
            "harness.group_size=2", "harness.concurrency=2", 'harness.tasks=["fizzbuzz"]', f"harness.command={cmd}"]
    env = {**os.environ, "GYRE_FAULT": "proxy:call_journaled:5", "GYRE_FAULT_DIR": str(tmp_path / "faults")}
    first = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert first.returncode == -signal.SIGKILL, first.stdout + first.stderr
    journaled = {f.stem: len(read_journal(f)) for f in (run_dir / "journal").glob("*.jsonl")}
    assert sum(journaled.values()) == 5 and records(run_dir) == []  # every answered call, and the 5th
    again = subprocess.run(args + ["--resume"], capture_output=True, text=True, timeout=400, env=env)
    assert again.returncode == 0, again.stdout + again.stderr
    final = records(run_dir)
    assert sorted(r.execution_id.rsplit("-a", 1)[0] for r in final) == ["fizzbuzz-g0", "fizzbuzz-g1"]
    replayed = {r.execution_id.rsplit("-a", 1)[0]: replayed_calls(r.tree) for r in final}
    for eid, n in journaled.items():  # the harness asks the same again: every journaled call answered from it
        assert replayed[eid.rsplit("-a", 1)[0]] == n, (replayed, journaled, again.stdout)
    assert all(r.status == "done" and r.execution_id.endswith("-a1") for r in final)
    assert "from a killed run's journal" in again.stdout and list((run_dir / "journal").iterdir()) == []
