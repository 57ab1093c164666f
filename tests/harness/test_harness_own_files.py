"""A harness's own files, named by a relative path as docs/recipes says, run under the default
sandbox (bubblewrap): the path is made absolute and the file bound read-only. A harness that
crashes by itself is recorded with its exit status and the end of its stderr."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from gyre.harness.runner import HarnessPool, own_files
from gyre.harness.tasks import BUILTIN_DIR, load_suite
from gyre.traj.record import Status

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
TASK = next(t for t in load_suite(BUILTIN_DIR) if t.name == "fizzbuzz")

AGENT = """import os, pathlib, sys
pathlib.Path(os.environ["GYRE_WORKSPACE"], "answer.md").write_text("from " + sys.argv[0])
"""
CRASH = """import sys
print("step 1 ok", file=sys.stderr)
print("ValueError: the harness's own bug", file=sys.stderr)
sys.exit(3)
"""


def run_one(tmp_path, script: str, name: str):
    (tmp_path / "agents").mkdir(exist_ok=True)
    (tmp_path / "agents" / name).write_text(script)
    pool = HarnessPool(tmp_path / "run", ["{python}", f"agents/{name}"])  # relative, as the recipes write it
    assert pool.envs.host_backend == "bwrap"
    return pool, asyncio.run(pool.run_execution(TASK, f"x-{name[:-3]}", api_key="k", base_url="http://127.0.0.1:9/v1"))


def test_relative_harness_script_runs_in_the_default_sandbox(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pool, res = run_one(tmp_path, AGENT, "agent.py")
    assert pool.own_files == [str((tmp_path / "agents" / "agent.py").resolve())]
    assert res.status == Status.DONE, (res, (Path(res.log_dir) / "harness.stderr").read_text())
    assert (Path(res.workspace) / "answer.md").read_text() == f"from {pool.own_files[0]}"


def test_a_crashing_harness_is_recorded_with_exit_status_and_stderr(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, res = run_one(tmp_path, CRASH, "crash.py")
    assert res.status == Status.FAILED and res.returncode == 3
    assert res.error.startswith("harness exited 3; stderr: step 1 ok | ValueError: the harness's own bug"), res.error
    assert res.error.endswith("harness.stderr)")


def test_own_files_leaves_placeholders_options_and_programs_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.py").write_text("")
    argv, files = own_files(["{python}", "-u", "a.py", "--out", "{workspace}/x", "missing.py"])
    assert argv == ["{python}", "-u", str(tmp_path.resolve() / "a.py"), "--out", "{workspace}/x", "missing.py"]
    assert files == [str(tmp_path.resolve() / "a.py")]
