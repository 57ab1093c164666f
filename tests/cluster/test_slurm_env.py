"""gyre.cluster.slurm without a cluster: host lists, the allocation, the config check, submit, status."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.cluster import slurm
from gyre.cluster.slurm import SlurmEnvError, allocation_from_env, cell_blocks, expand_hostlist
from gyre.config import load_config

REPO = Path(__file__).resolve().parents[2]


def het_env(cells: str = "node[01-08]", **extra) -> dict:
    env = {"SLURM_JOB_ID": "41", "SLURM_HET_SIZE": "2", "SLURM_JOB_NODELIST_HET_GROUP_0": "head",
           "SLURM_JOB_NODELIST_HET_GROUP_1": cells, "SLURM_GPUS_PER_NODE_HET_GROUP_1": "8",
           "SLURM_SUBMIT_DIR": "/submit", "SLURM_JOB_PARTITION_HET_GROUP_0": "head",
           "SLURM_JOB_PARTITION_HET_GROUP_1": "cells"}
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


def test_expand_hostlist():
    assert expand_hostlist("head,node[01-03,07]") == ["head", "node01", "node02", "node03", "node07"]
    assert expand_hostlist("gpu[8-10]-ib,x1") == ["gpu8-ib", "gpu9-ib", "gpu10-ib", "x1"]
    assert expand_hostlist("r[1-2]n[01-02]") == ["r1n01", "r1n02", "r2n01", "r2n02"]
    assert expand_hostlist("") == []
    for bad in ("node[01-", "node]1", "node[3-1]", "node[a]"):
        with pytest.raises(SlurmEnvError, match="bad host list"):
            expand_hostlist(bad)


def test_allocation_from_env():
    a = allocation_from_env(het_env(SLURM_RESTART_COUNT="2"))
    assert a.head_nodes == ["head"] and a.cell_nodes == [f"node{i:02d}" for i in range(1, 9)]
    assert a.gpus_per_node == 8 and a.restart_count == 2 and a.job_id == "41"
    assert allocation_from_env(het_env(SLURM_GPUS_PER_NODE_HET_GROUP_1="h100:4")).gpus_per_node == 4
    assert allocation_from_env(het_env(SLURM_GPUS_PER_NODE_HET_GROUP_1=None)).gpus_per_node is None


@pytest.mark.parametrize("drop,match", [
    ("SLURM_JOB_ID", "not inside a Slurm job"),
    ("SLURM_HET_SIZE", "not a heterogeneous job"),
    ("SLURM_JOB_NODELIST_HET_GROUP_1", "SLURM_JOB_NODELIST_HET_GROUP_1 is not set"),
])
def test_allocation_missing(drop, match):
    env = het_env()
    del env[drop]
    with pytest.raises(SlurmEnvError, match=match):
        allocation_from_env(env)


def test_rank_from_env():
    r = slurm.rank_from_env({"SLURM_PROCID": "2", "SLURM_NTASKS": "3", "SLURMD_NODENAME": "node05"})
    assert (r.procid, r.ntasks, r.nodename) == (2, 3, "node05")
    with pytest.raises(SlurmEnvError, match="not started by srun"):
        slurm.rank_from_env({})


def test_cell_blocks_and_mismatch():
    cfg = load_config(None, ["sched.cells=2", "sched.cell_nodes=4", "sched.gpus_per_node=8"])
    blocks = cell_blocks(allocation_from_env(het_env()), cfg)
    assert blocks == [["node01", "node02", "node03", "node04"], ["node05", "node06", "node07", "node08"]]
    with pytest.raises(SlurmEnvError) as e:
        cell_blocks(allocation_from_env(het_env("node[01-07]")), cfg)
    msg = str(e.value)
    assert "has 7 nodes" in msg and "needs 8" in msg and "--nodes=8" in msg
    with pytest.raises(SlurmEnvError, match="--gpus-per-node=8 or set sched.gpus_per_node=4"):
        cell_blocks(allocation_from_env(het_env(SLURM_GPUS_PER_NODE_HET_GROUP_1="4")), cfg)
    with pytest.raises(SlurmEnvError, match="must be 1 node"):
        cell_blocks(allocation_from_env(het_env(SLURM_JOB_NODELIST_HET_GROUP_0="head,head2")), cfg)


def test_prepare(tmp_path):
    run = tmp_path / "run"
    env = het_env(SLURM_SUBMIT_DIR=str(tmp_path))
    out = slurm.prepare(None, [f"run.dir={run}", "sched.cells=2", "sched.cell_nodes=4"], env)
    assert out["GYRE_CELL_NODES"] == "node01,node05" and out["GYRE_N_CELLS"] == "2"
    assert out["GYRE_RESUME_FLAG"] == "" and out["GYRE_EXTRA_OVERRIDES"] == "engine.host=0.0.0.0"
    rec = json.loads((run / "slurm.json").read_text())
    assert rec["cells"][1] == {"cell": 1, "nodes": ["node05", "node06", "node07", "node08"], "rank_node": "node05"}
    assert (run / "engine.key").stat().st_mode & 0o777 == 0o600
    (run / "state.json").write_text("{}")
    with pytest.raises(SlurmEnvError, match="GYRE_RESUME=1"):
        slurm.prepare(None, [f"run.dir={run}", "sched.cells=2", "sched.cell_nodes=4"], env)
    out = slurm.prepare(None, [f"run.dir={run}", "sched.cells=2", "sched.cell_nodes=4"], {**env, "SLURM_RESTART_COUNT": "1"})
    assert out["GYRE_RESUME_FLAG"] == "--resume" and out["GYRE_RESOLVED_CONFIG"] == ""
    from gyre.report import config_file  # a run that stored its configuration: a requeue starts from it

    config_file.write(load_config(None, [f"run.dir={run}", "sched.cells=2", "sched.cell_nodes=4", "run.steps=9"]), run)
    out = slurm.prepare(None, [f"run.dir={run}"], {**env, "SLURM_RESTART_COUNT": "1"})
    assert out["GYRE_RESOLVED_CONFIG"] == str(run / "config.toml") and out["GYRE_STEPS"] == "9"
    assert out["GYRE_N_CELLS"] == "2"


def test_prepare_cli_fails_with_message(tmp_path):
    """What the batch script sees for 7 nodes and cells of 4: exit 2 and the fix on stderr."""
    env = {**het_env("node[01-07]"), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-m", "gyre.cluster.slurm", "prepare", f"run.dir={tmp_path}/r",
                        "sched.cells=2", "sched.cell_nodes=4"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "has 7 nodes" in r.stderr and "--nodes=8" in r.stderr


def test_submit_dry_run(tmp_path, capsys):
    p = argparse.ArgumentParser()
    slurm.submit_add_arguments(p)
    args = p.parse_args(["--config", str(REPO / "launchers/demo.toml"), "--dry-run", "--mpi", "pmix",
                         "--cell-partition", "gpu", "--signal-lead", "120", f"run.dir={tmp_path}/r", "sched.cells=3",
                         "sched.cell_nodes=2", "sched.gpus_per_node=4"])
    assert slurm.submit_run(args) == 0
    text = (tmp_path / "r" / "gyre.sbatch").read_text()
    assert "#SBATCH hetjob" in text and "--partition=gpu --nodes=6" in text and "--gpus-per-node=4" in text
    assert "#SBATCH --signal=B:USR1@120" in text and "export GYRE_MPI=pmix" in text
    assert "srun --quiet --mpi=" in text and "scontrol requeue" in text
    assert subprocess.run(["bash", "-n", str(tmp_path / "r" / "gyre.sbatch")]).returncode == 0


def test_status_from_files(tmp_path, capsys):
    run = tmp_path
    (run / "slurm.json").write_text(json.dumps({"job_id": "7", "head": "head", "restart_count": 1, "cells": [
        {"cell": 0, "nodes": ["node01", "node02"], "rank_node": "node01"}]}))
    (run / "state.json").write_text(json.dumps({"version": 2}))
    (run / "steps.jsonl").write_text('{"step": 0, "reward_mean": 0.1}\n{"step": 1, "reward_mean": 0.25}\n')
    (run / "ledger.jsonl").write_text('{"execution": "a", "admitted": true}\n{"resume": true}\n'
                                      '{"execution": "b", "admitted": false}\n')
    (run / "cells.json").write_text(json.dumps({"cells": [{"cell": 0, "role": "train", "hostname": "node01"}]}))
    st = slurm.collect_status(run)
    assert st["steps_done"] == 2 and st["version"] == 2 and st["executions_trained"] == 1 and st["resumes"] == 1
    assert st["cells"] == [{"cell": 0, "nodes": ["node01", "node02"], "hostname": "node01", "role": "train",
                            "mb_in_flight": None}]
    p = argparse.ArgumentParser()
    slurm.status_add_arguments(p)
    assert slurm.status_run(p.parse_args([str(run)])) == 0
    out = capsys.readouterr().out
    assert "steps done 2" in out and "cell 0: rank on node01" in out and "role train" in out


def test_status_says_a_cancelled_job_is_cancelled_with_the_resume_command(tmp_path, monkeypatch, capsys):
    import os
    import stat as st_mod

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # the job left the queue: squeue knows nothing, sacct says how it ended (real processes on PATH)
    for name, out in (("squeue", ""), ("sacct", "CANCELLED by 1000")):
        f = bin_dir / name
        f.write_text(f"#!/bin/sh\necho '{out}'\n")
        f.chmod(f.stat().st_mode | st_mod.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    run = tmp_path / "run"
    run.mkdir()
    (run / "slurm.json").write_text(json.dumps({"job_id": "7", "head": "head", "cells": []}))
    st = slurm.collect_status(run)
    assert st["job_state"] == "CANCELLED"
    p = argparse.ArgumentParser()
    slurm.status_add_arguments(p)
    assert slurm.status_run(p.parse_args([str(run)])) == 0
    out = capsys.readouterr().out
    assert "job cancelled before the run finished" in out and f"gyre submit --resume run.dir={run}" in out
    assert slurm.run_state({"job_state": "PENDING", "restart_count": 1, "finished": False, "stopped": False}) \
        .startswith("requeued")


def test_the_jobs_python_must_import_what_every_rank_imports():
    slurm.check_job_python(("json", "gyre"))
    with pytest.raises(slurm.SlurmEnvError, match="cannot import no_such_module_xyz.*GYRE_PYTHON"):
        slurm.check_job_python(("json", "no_such_module_xyz"))


def _fake_slurm(tmp_path, monkeypatch, squeue: str, sacct: str) -> None:
    import os
    import stat as st_mod

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, out in (("squeue", squeue), ("sacct", sacct)):
        f = bin_dir / name
        f.write_text(f"#!/bin/sh\nprintf '{out}'\n")
        f.chmod(f.stat().st_mode | st_mod.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_status_of_a_job_slurm_forgot_says_it_ended_with_total_and_head(tmp_path, monkeypatch, capsys):
    from gyre.config import load_config
    from gyre.report import config_file

    _fake_slurm(tmp_path, monkeypatch, "", "")  # purged from the accounting: neither knows job 7
    run = tmp_path / "run"
    run.mkdir()
    (run / "slurm.json").write_text(json.dumps({"job_id": "7", "head": "headnode", "cells": []}))
    config_file.write(load_config(None, ["run.steps=10"]), run)
    (run / "steps.jsonl").write_text('{"step": 0, "t_end": 60.0}\n{"step": 1, "t_end": 120.0}\n')
    p = argparse.ArgumentParser()
    slurm.status_add_arguments(p)
    assert slurm.status_run(p.parse_args([str(run)])) == 0
    out = capsys.readouterr().out
    assert "steps done 2/10" in out and "ETA 8m00s" in out and "head on headnode" in out, out
    assert "Slurm no longer knows job 7" in out and "running or not started" not in out, out


def test_status_of_a_local_run_whose_head_is_gone_says_so(tmp_path, capsys):
    import socket

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs
    (tmp_path / "state.json").write_text(json.dumps({"version": 1}))
    (tmp_path / "head.json").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid}))
    p = argparse.ArgumentParser()
    slurm.status_add_arguments(p)
    assert slurm.status_run(p.parse_args([str(tmp_path)])) == 0
    out = capsys.readouterr().out
    assert "head process is gone" in out and "gyre run --resume" in out, out


def test_status_refuses_a_directory_that_is_not_a_run(tmp_path, capsys):
    p = argparse.ArgumentParser()
    slurm.status_add_arguments(p)
    (tmp_path / "notes.txt").write_text("hello")
    assert slurm.status_run(p.parse_args([str(tmp_path)])) == 2
    assert "is not a run directory" in capsys.readouterr().err


def test_submit_resume_reuses_the_runs_stored_configuration(tmp_path, capsys):
    from gyre.report import config_file

    run = tmp_path / "r"
    run.mkdir()
    (run / "state.json").write_text(json.dumps({"version": 1}))
    config_file.write(load_config(None, [f"run.dir={run}", "sched.cells=3", "sched.cell_nodes=2"]), run)
    p = argparse.ArgumentParser()
    slurm.submit_add_arguments(p)
    assert slurm.submit_run(p.parse_args(["--resume", "--dry-run", f"run.dir={run}"])) == 0  # nothing retyped
    out = capsys.readouterr().out
    assert "--nodes=6" in out and f"{run / 'config.toml'} run.dir={run}" in out
    assert f"#SBATCH --output={run}/gyre-%j.out" in out
    with pytest.raises(SystemExit, match="--config FILE is needed"):
        slurm.submit_run(p.parse_args(["--dry-run", f"run.dir={tmp_path / 'fresh'}"]))
