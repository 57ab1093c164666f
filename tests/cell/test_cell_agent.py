"""Cell agents under MPI: two real agents (engine + trainer child each) driven by a test head.

One `mpiexec -n 3` run (tests/mpi_scripts/cell_head.py) plays the whole scenario and records
what the head saw; the tests below check it. The run sits in a wall-clock bound and its own
process group, so a hang fails the test instead of hanging CI.
"""

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.cell.mpi_link import one_machine_env
from gyre.model.tiny import ensure_tiny_model

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "mpi_scripts" / "cell_head.py"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
BOUND_S = 300


def _mpiexec() -> str | None:
    return shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")


def mpi_run(script: Path, ranks: int, base: Path, key_mode: int, bound_s: int) -> tuple[int, dict, str]:
    """Run `script` under mpiexec in its own process group, within `bound_s` seconds; returns
    (exit code, the JSON the head wrote, output)."""
    mpiexec = _mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec (pip install mpich, or load the site's MPI)")
    model = ensure_tiny_model(base / "tiny")
    key = base / "engine.key"
    key.touch(mode=0o600)
    key.write_text("cell-test-key")
    key.chmod(key_mode)
    out = base / "out.json"
    cmd = ["timeout", "-k", "10", str(bound_s), mpiexec, "-n", str(ranks), sys.executable, str(script),
           str(base / "run"), str(model), str(key), str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=one_machine_env())
    try:
        log, _ = proc.communicate(timeout=bound_s + 20)
    finally:  # engines and trainers of ranks that died must not outlive the test
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    assert out.exists(), f"the head wrote no results (exit {proc.returncode}):\n{log[-4000:]}"
    return proc.returncode, json.loads(out.read_text()), log


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    rc, data, log = mpi_run(SCRIPT, 3, tmp_path_factory.mktemp("cells"), 0o600, BOUND_S)
    assert "error" not in data, data["error"] + "\n" + log[-4000:]
    return rc, data, log


def test_hello_carries_working_engine_urls(run):
    _, d, _ = run
    assert set(d["hello"]) == {"0", "1"}
    for cell, info in d["hello"].items():
        assert info["cell"] == int(cell) and info["engine_url"].startswith("http://")
        assert info["engine_pid"] > 0 and info["trainer_pid"] > 0 and info["version"] == 0
        assert info["trainer_ranks"] == 1 == len(info["trainer_hosts"])  # train.local_ranks (N x M: test_cell_agent_parts)
    assert d["checks"]["hello_generate"] == [200, 200]
    assert d["checks"]["health_without_key"] == 401  # the job's key guards the endpoint


def test_to_train_releases_engine_and_restores_trainer(run):
    _, d, _ = run
    for r in d["to_train_1"]:
        assert r["ok"], r["error"]
        assert {"drain", "release", "restore", "load", "total"} <= set(r["phases"])
        assert r["info"]["role"] == "train" and r["info"]["version"] == 0
    assert d["checks"]["generate_after_to_train"] == [503, 503]


def test_reduce_over_both_cells_equals_one_trainer_on_both_micro_batches(run):
    _, d, _ = run
    for r in d["train_step0"]:
        assert r["ok"], r["error"]
        assert r["info"]["stats"]["targets"] > 0
    assert [r["info"]["mb_ids"] for r in d["prepare_step0"]] == [[0], [1]]
    assert all(r["info"]["lost"] == [] for r in d["prepare_step0"])
    norms = []
    for r in d["reduce_step0"]:
        assert r["ok"], r["error"]
        assert r["info"]["version"] == 1
        norms.append(r["info"]["grad_norm"])
    assert norms[0] == norms[1] == pytest.approx(d["ref_grad_norm_1"], rel=1e-6)
    # the first reduce over {0, 1} formed its group; after cell 1's trainer
    # was restarted (a new incarnation) the same membership formed a new one
    assert all(not r["info"]["group_cached"] and r["info"]["group_form_ms"] > 0 for r in d["reduce_step0"])
    assert all(not r["info"]["group_cached"] for r in d["reduce_step2"])
    assert d["checks"]["v1_max_diff"] <= 1e-6  # leader (cell 0) export vs the reference


def test_reduce_over_a_subset_does_not_wait_for_the_other_cell(run):
    _, d, _ = run
    r = d["reduce_step1"]
    assert r["ok"], r["error"]
    assert r["info"]["version"] == 2 and r["info"]["mb_ids"] == [2]
    # cell 1 led this step from its own replica of step 0: equal to the reference means the two
    # cells held identical weights after the joint reduce
    assert d["checks"]["v2_max_diff"] <= 1e-6
    assert d["to_rollout_1"][0]["ok"], d["to_rollout_1"][0]["error"]  # cell 0 answered meanwhile


def test_to_rollout_resumes_the_engine_with_the_new_weights(run):
    _, d, _ = run
    for r in d["to_rollout_1"]:
        assert r["ok"], r["error"]
        assert {"stash", "offload", "resume", "load"} <= set(r["phases"])
    assert d["checks"]["weight_version_cell0"] == "1"
    assert d["checks"]["weight_version_cell1"] == "2"
    assert d["checks"]["generate_after_to_rollout"] == [200, 200]
    assert d["push_weights"]["ok"] and d["push_weights"]["info"]["weight_version"] == "2"


def test_engine_kill_restarts_it_on_a_new_url_with_current_weights(run):
    _, d, _ = run
    ev = d["engine_restarted"]
    assert ev["exit_code"] == -9 and ev["engine_url"] != ev["old_url"]
    assert d["checks"]["restarted_generate"] == 200
    assert d["checks"]["restarted_weight_version"] == "2"


def test_trainer_kill_reports_lost_micro_batches_and_the_step_completes(run):
    _, d, _ = run
    # cell 0 caught up from the checkpoint of v2 (its trainer was at step 1)
    assert [r["info"]["version"] for r in d["to_train_2"]] == [2, 2]
    assert d["train_before_kill"]["ok"]
    # reported once, by the first reply after the kill that carries `lost`
    lost = set(d["prepare_after_kill"]["info"]["lost"]) | set(d["train_after_kill"]["info"].get("lost", []))
    assert 10 in lost  # trained before the kill: its gradients died with the trainer
    if not d["train_after_kill"]["ok"]:  # the kill was noticed by this command
        assert set(d["train_after_kill"]["info"]["lost"]) == {10, 11}
        assert d["prepare_after_kill"]["info"]["lost"] == []  # not twice
    assert set(d["trainer_restarted"]["lost"]) <= lost
    assert all(r["ok"] for r in d["reduce_step2"]), d["reduce_step2"]
    assert d["checks"]["v3_max_diff"] <= 1e-6  # the handed-over micro-batches made the same step


def test_stop_ends_every_rank_with_exit_code_0(run):
    rc, d, log = run
    assert all(r["ok"] for r in d["stop"]), d["stop"]
    assert rc == 0, log[-3000:]
    assert d["heartbeats"] > 0


def test_switch_control_path_times(run):
    _, d, _ = run
    lines = []
    for kind, replies in d["switches"].items():
        assert all(r["ok"] for r in replies), replies
        phases = sorted({p for r in replies for p in r["phases"]})
        med = {p: 1000 * statistics.median(r["phases"].get(p, 0.0) for r in replies) for p in phases}
        rtt = 1000 * statistics.median(r["info"]["rtt_s"] for r in replies)
        lines.append(f"{kind}: head round trip {rtt:.1f} ms; " +
                     ", ".join(f"{p} {v:.1f} ms" for p, v in med.items()))
    print("\nswitch control path (median of %d, embedded tiny model):\n  " % len(replies) + "\n  ".join(lines))


def test_a_cell_that_cannot_start_reports_and_answers_until_stop(tmp_path):
    rc, d, log = mpi_run(SCRIPT.parent / "cell_start_fail.py", 2, tmp_path, 0o644, 60)
    kind, info = d["first_event"]
    assert kind == "fatal" and "readable by others" in info["error"]
    assert not d["to_train"]["ok"] and "failed to start" in d["to_train"]["error"]
    assert d["to_train"]["seq_matches"] and d["stop"]["ok"]
    assert rc == 0, log[-3000:]
