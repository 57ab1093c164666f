"""`sbatch launchers/gyre.sbatch` on a real multi-node Slurm (slurm/devcluster.sh: head + 8 nodes,
network namespaces on this machine).

Skipped with the reason when the machine cannot host the dev cluster (not root, Slurm/munge
packages missing, no network namespaces). Every wait is bounded; a job still there at the end of
its bound is cancelled and its output shown.
"""

from __future__ import annotations

import collections
import json
import subprocess
import time
from pathlib import Path

import pytest
from gyre.config import load_config
from gyre.engine.backends.vllm import vllm_python
from gyre.model.tiny import SERVING_HEAD_DIM, ensure_tiny_model
from support.devcluster import _tail, cluster, job_states, REPO, sbatch, wait_gone, wait_gone_quiet  # noqa: F401  (cluster: a fixture)

SBATCH = REPO / "launchers" / "gyre.sbatch"
DEMO = REPO / "launchers" / "demo.toml"
# the demo on 1 head + 2 cells x 2 nodes (a trainer rank on every node), small enough for ~1 min per job
FAST = ["run.steps=2", "harness.group_size=4", "sched.cells=2", "sched.cell_nodes=2", "sched.gpus_per_node=8"]
CELL_NODES = [["node01", "node02"], ["node03", "node04"]]
# issue 43 on Slurm, in the same job: a validation round before the first step, after each step and
# after the last (v0, v1, v2), 2 samples of one held-out task each, and every execution (training
# and validation) scored by the recipe's reward function, named by a path relative to the submit
# directory and run on the head node in the harness's sandbox
VALIDATE_AND_REWARD = ["validate.every_steps=1", "validate.suite=learnable", 'validate.tasks=["short_answer"]',
                       "validate.samples=2", "validate.k=2", "reward.function=reward_fn:score",
                       'reward.pythonpath=["docs/recipes"]']


def vllm_engine(model: Path) -> list[str]:
    """The cells' engines as real vLLM servers (the CPU build of `make install-vllm`), reachable from
    the head's node; skipped without it, as tests/engine/test_vllm_engine.py is. The paper's elastic
    rule with 4 executions a cell makes each cell switch rollout -> train -> rollout, so vLLM is
    paused, loads pushed weights and resumes in the same job (a vLLM start is ~40 s of CPU a cell:
    this one job carries every whole-loop check on vLLM)."""
    cfg = load_config(None, ["engine.backend=vllm"])
    if not vllm_python(cfg).exists():
        pytest.skip(f"no vLLM environment at {vllm_python(cfg)}: run `make install-vllm`")
    return ["engine.backend=vllm", f"model.path={model}", "engine.host=0.0.0.0", "engine.max_running_requests=16",
            "sched.scheme=E-paper", "sched.execs_per_cell=4"]


def sbatch_script(tmp_path: Path, nodes: int = 4) -> Path:
    """launchers/gyre.sbatch with component 1 = 4 nodes (2 cells x 2), or `nodes`."""
    script = tmp_path / f"gyre{nodes}.sbatch"
    script.write_text(SBATCH.read_text().replace("--partition=cells --nodes=8", f"--partition=cells --nodes={nodes}"))
    return script


# requeue and scancel concern the job, not the cell layout (test_sbatch_demo_* checks 2 x 2 nodes):
# 2 cells of one node each start half the processes. Not one cell: then the restarted job's
# executions (replayed from their journals) ended before the USR1 landed, and part 2 was skipped.
ONE_NODE_CELLS = [*FAST, "sched.cell_nodes=1"]
# start-up failures end the job whatever its layout: one cell of one node starts a quarter of the
# processes (every cell is an agent, an engine and a trainer)
ONE_CELL = [*FAST, "sched.cells=1", "sched.cell_nodes=1"]

pytestmark = pytest.mark.timeout(600)


def wait_for(cond, timeout: float, what: str, env: dict, job: str, out: Path) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        if not job_states(env, job):
            pytest.fail(f"job {job} ended before {what}; its output:\n{_tail(out)}")
        time.sleep(0.3)
    subprocess.run(["scancel", job], env=env, capture_output=True, timeout=30)
    wait_gone_quiet(env, job, 30)
    pytest.fail(f"no {what} within {timeout} s (job {job} cancelled); its output:\n{_tail(out)}")


def _lines(p: Path) -> list[dict]:
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []


def test_sbatch_demo_two_cells_of_two_nodes_use_every_node(cluster, tmp_path):
    """1 head + 2 cells x 2 nodes: >= 2 steps; each cell's agent on its first node, its trainer
    ranks on both of its nodes (hostnames the ranks report), one engine per cell: a real vLLM
    server (the CPU build serves from the cell's node 0), switched both ways, with token truth
    held and every call's weight version the one vLLM reported. The same job validates and scores
    with a reward function (VALIDATE_AND_REWARD, checked at the end)."""
    run, out = tmp_path / "run", tmp_path / "job.out"
    model = ensure_tiny_model(tmp_path / "tiny-qwen-hd32", head_dim=SERVING_HEAD_DIM)
    t0 = time.time()
    job = sbatch(cluster, ["-o", out, sbatch_script(tmp_path), DEMO, f"run.dir={run}", *FAST, *VALIDATE_AND_REWARD,
                           *vllm_engine(model)])
    # two vLLM servers start on a loaded 2-core machine: ~90 s beside a busy loop
    wait_for(lambda: bool(_lines(run / "steps.jsonl")), 480, "first step", cluster, job, out)
    first = time.time() - t0
    wait_gone(cluster, job, 240, out)
    print(f"sbatch -> first step {first:.1f} s, -> job gone {time.time() - t0:.1f} s")
    assert (run / "report.json").exists(), _tail(out)
    report = json.loads((run / "report.json").read_text())
    assert not report["stopped"] and not report["errors"], report["errors"]
    assert len(report["steps"]) >= 2
    layout = json.loads((run / "slurm.json").read_text())
    assert [c["nodes"] for c in layout["cells"]] == CELL_NODES
    # each cell rank ran where it was pinned: the first node of its block
    assert [c["hostname"] for c in report["cells"]] == ["node01", "node03"]
    for i, nodes in enumerate(CELL_NODES):
        cell = json.loads((run / "cells" / f"cell{i}.json").read_text())
        assert sorted(cell["trainer_hosts"]) == nodes, cell  # one rank per node (CPU), from the ranks
        assert cell["engine_backend"] == "vllm" and cell["engine_nodes"] == nodes[:1], cell
    for step in report["steps"]:  # the trainer took exactly the tokens vLLM sampled, at its log-probs
        assert step["grad_norm"] is not None and step["grad_norm"] > 0, step
        assert step["audit_tokens"] > 0 and step["audit_mismatched_tokens"] == 0, step
        assert step["mismatch_tokens_lag0"] > 0 and step["mismatch_k3_lag0"] < 1e-6, step
    assert report["harness_errors"] == 0 and set(report["executions"]) == {"done"}, report["executions"]
    _vllm_switched_both_ways_and_served_each_version(run, report)
    for c in report["cells"]:  # per-cell stats as with `gyre run`
        assert {"rollout_s", "train_s", "switching_s", "utilisation"} <= set(c)
    from gyre.cluster.slurm import collect_status

    st = collect_status(run)
    assert st["steps_done"] >= 2 and st["finished"] and [c["hostname"] for c in st["cells"]] == ["node01", "node03"]
    assert "run ended cleanly" in _tail(out), _tail(out)  # the step exited 0
    _validated_and_rewarded(run, _tail(out, 1_000_000))


def _vllm_switched_both_ways_and_served_each_version(run: Path, report: dict) -> None:
    """A cell went rollout -> train -> rollout on vLLM (pause, weight reload, resume), and every
    call records the weight version vLLM reported for it: step 1 on "0", step 2 on the trainer's
    version 1, pushed to vLLM from its export."""
    from gyre.traj.store import iter_executions

    roles = [[r for r, a, b in report["intervals"][str(c)] if b > a] for c in range(2)]
    assert [i for i, rs in enumerate(roles) if "train" in rs and "rollout" in rs[rs.index("train"):]], roles
    calls = [c for r in iter_executions(run / "shards") for c in r.tree.calls]
    assert {c.weight_version for c in calls} == {"0", "1"}
    assert all(c.weight_version == str(c.policy_version) for c in calls)
    assert list((run / "weights" / f"v{report['version']}").glob("model*.safetensors")), report["version"]


def _validated_and_rewarded(run: Path, text: str) -> None:
    """VALIDATE_AND_REWARD held on Slurm: three rounds with pass@1 and the reward's parts, every
    reward call recorded without an error, the trained executions scored by the function."""
    from gyre.traj.store import iter_executions

    rounds = {r["round"]: r for r in _lines(run / "validation.jsonl") if r["kind"] == "round"}
    assert set(rounds) == {"v0", "v1", "v2"}, rounds.keys()
    for r in rounds.values():
        assert r["executions"] == 2 and r["unscored"] == 0 and 0.0 <= r["pass@1"] <= 1.0, r
        assert set(r["parts"]) == {"tests", "brevity", "truncation"}, r
        assert f"gyre: validation {r['round']}: pass@1 " in text
    rewards = _lines(run / "rewards.jsonl")
    trained = list(iter_executions(run / "shards"))
    assert trained and len(rewards) == len(trained) + 3 * 2, (len(rewards), len(trained))
    assert [r for r in rewards if r["error"]] == [] and {r["sandbox"] for r in rewards} == {"bwrap"}
    assert {r.reward_source for r in trained} <= {"reward", "reward-after-timeout"}


def test_mismatched_allocation_fails_at_once(cluster, tmp_path):
    """7 nodes for 2 cells of 4: the job ends within seconds, saying what to change."""
    script = tmp_path / "gyre7.sbatch"
    script.write_text(SBATCH.read_text().replace("--partition=cells --nodes=8", "--partition=cells --nodes=7"))
    run, out = tmp_path / "run", tmp_path / "job.out"
    t0 = time.time()
    job = sbatch(cluster, ["-o", out, script, DEMO, f"run.dir={run}", *FAST, "sched.cell_nodes=4"])
    wait_gone(cluster, job, 60, out)
    text = _tail(out)
    assert time.time() - t0 < 60
    assert "component 1 (the cells) has 7 nodes" in text and "needs 8" in text and "--nodes=8" in text, text
    assert "nothing started" in text and not (run / "report.json").exists() and not (run / "head.pid").exists()


REFERENCE = ('harness.command=["{python}", "-m", "gyre.harness.reference_agent", "--max-tokens", "24", '
             '"--max-turns", "12", "--compact-chars", "900"]')


@pytest.mark.timeout(1800)  # three job starts; beside heavy neighbours each took minutes
def test_head_sigkill_then_preemption_each_requeue_replays_what_was_running(cluster, tmp_path):
    """One job, two interruptions, three starts (one job: each start is most of its cost):
    1. issue 34: the head SIGKILLed mid-run (at a named phase: a call in its journal, its answer not
       yet sent), then the job requeued (as Slurm does on a node failure): the restarted job resumes
       and each execution the head was running continues by replay of its journal in a fresh
       workspace (no engine time for what was recorded);
    2. USR1 (as --signal=B:USR1@N sends it) while an execution of the restarted job is mid-run
       (the reference harness, builtin suite): the head stops, the job requeues, resumes from state.json; each
       execution the head stopped is resumed by replay, its recorded calls answered from the
       recording.
    The job finishes: every step once, nothing trains twice."""
    from gyre.proxy.journal import read_journal
    from gyre.traj.store import iter_executions

    run, out, faults_dir = tmp_path / "run", tmp_path / "job.out", tmp_path / "faults"
    args = ["-o", out, "--open-mode=append", sbatch_script(tmp_path, 2), DEMO, f"run.dir={run}", *ONE_NODE_CELLS,
            "run.steps=2", "harness.suite=builtin", 'harness.tasks=["fizzbuzz", "roman"]', REFERENCE,
            "harness.group_size=2",
            # the reference agent scores 0 on these tasks: replacing zero-variance groups would
            # run 3x the executions and test nothing more here
            "sched.max_replacements_per_step=0"]
    job = sbatch(cluster, args, {"GYRE_FAULT": "proxy:call_journaled:6", "GYRE_FAULT_DIR": str(faults_dir)})

    def restarts() -> int:
        return _tail(out, 1_000_000).count("(resuming)")

    # 1. the head killed itself; --kill-on-bad-exit ended the step and the job
    wait_gone(cluster, job, 600, out)
    assert (faults_dir / "fired-proxy-call_journaled-6").exists(), _tail(out)
    journaled = {f.stem: len(read_journal(f)) for f in (run / "journal").glob("*.jsonl")}
    assert sum(journaled.values()) >= 6 and all(journaled.values()), journaled
    errors = []
    list(iter_executions(run / "shards", on_error=errors.append))
    assert not errors, errors  # what was recorded before the kill reads back
    assert json.loads((run / "state.json").read_text())["version"] >= 0  # whole: written atomically
    subprocess.run(["scontrol", "requeue", job], env=cluster, check=True, timeout=30)
    wait_for(lambda: restarts() >= 1, 300, "restart with --resume", cluster, job, out)

    # 2. USR1 once an execution of the restarted job has finished a turn (its harness log says so):
    # it is mid-run with calls recorded, as a long execution is when a job is preempted
    def past_turn_2() -> set[Path]:
        return {p for p in (run / "logs").glob("*/harness.stderr") if "turn 2:" in p.read_text()}

    before = past_turn_2()
    wait_for(lambda: past_turn_2() - before, 400, "an execution of the restarted job mid-run", cluster, job, out)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=cluster, check=True, timeout=30)
    wait_for(lambda: restarts() >= 2, 300, "the second restart with --resume", cluster, job, out)
    wait_gone(cluster, job, 600, out)  # a generous bound: two steps on a loaded 2-core machine took 6 min

    text = _tail(out, 100000)
    report = json.loads((run / "report.json").read_text())
    assert not report["stopped"] and not report["errors"], text
    assert sorted(r["step"] for r in _lines(run / "steps.jsonl")) == [0, 1]
    ledger = _lines(run / "ledger.jsonl")
    assert sum(1 for r in ledger if r.get("resume")) >= 2  # both restarts resumed from state.json
    trained = collections.Counter(r["execution"] for r in ledger if r.get("admitted") is True)
    assert trained and max(trained.values()) == 1, trained.most_common(3)
    resumed = [r for r in ledger if "resumed" in r]
    by_source = {r["from"]: r for r in resumed}
    assert len(by_source) == len(resumed)  # each recording taken over once
    recs = {r.execution_id: r for r in iter_executions(run / "shards")}
    # 1: each journaled execution resumed once, every call answered from its journal
    assert set(journaled) <= set(by_source), (by_source, journaled)
    for source, n in journaled.items():
        r = by_source[source]
        assert r["recorded_calls"] == n and r["replayed_calls"] == n, (r, n)
        new = recs[r["resumed"]]
        assert sum(c.endpoint == "replay" for c in new.tree.calls) == n, new.status
        # done, or stopped again by the USR1 and then itself resumed
        assert new.status == "done" or (new.status == "stopped" and new.execution_id in by_source), new.status
    assert list((run / "journal").iterdir()) == []  # taken over: gone once their executions are in shards
    # 2: each execution the USR1 stopped with calls recorded, resumed by replay in a fresh workspace
    stopped = {eid: len(r.tree.calls) for eid, r in recs.items() if r.status == "stopped"}
    print(f"\njournaled: {len(journaled)}; stopped with calls: {sum(1 for n in stopped.values() if n)}; "
          f"resumed: {len(resumed)}; replayed {sum(r['replayed_calls'] for r in resumed)} of "
          f"{sum(r['recorded_calls'] for r in resumed)} calls")
    from_stopped = [r for r in resumed if r["from"] in stopped]
    for r in from_stopped:
        new, old = recs[r["resumed"]], recs[r["from"]]
        assert r["recorded_calls"] == stopped[r["from"]] and r["replayed_calls"] >= 1, r
        assert new.workspace != old.workspace
        assert sum(c.endpoint == "replay" for c in new.tree.calls) == r["replayed_calls"]
    if not any(stopped.values()):
        pytest.skip("the USR1 landed when no running execution had made a call yet (part 1 held)")
    assert from_stopped
