"""Any process that fails at start ends the whole job within seconds, non-zero, saying why.

Before, a wrong model.path printed a traceback on the head rank while mpiexec and the cell ranks
waited for it forever (under Slurm: until the allocation's time limit). Each process that can fail
at start (head, cell agent, engine, trainer) is killed at its `start` fault phase (gyre/faults.py),
and the paths a run needs are refused before anything is launched.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gyre.cluster.preflight import check_harness_command, check_model_dir
from gyre.config import ConfigError
from support.gyre_run import ROOT, gyre_run


def test_model_dir_checks_name_what_is_missing(tmp_path):
    with pytest.raises(ConfigError, match="no such directory"):
        check_model_dir(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    with pytest.raises(ConfigError, match=r"no \*\.safetensors"):
        check_model_dir(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        check_model_dir(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "gpt_bigcode"}')
    with pytest.raises(ConfigError, match="not supported"):
        check_model_dir(str(tmp_path))


def test_harness_command_must_be_an_argv_list_of_a_program_that_exists():
    with pytest.raises(ConfigError, match="write it as a list"):
        check_harness_command(["python my_agent.py {prompt_file}"])
    with pytest.raises(ConfigError, match="not found"):
        check_harness_command(["no-such-agent-program", "{prompt_file}"])
    check_harness_command(["{python}", "-m", "gyre.harness.reference_agent"])


@pytest.mark.e2e
@pytest.mark.slow
def test_wrong_model_path_ends_gyre_run_at_once(tmp_path):
    t0 = time.monotonic()
    rc, out = gyre_run(tmp_path / "r", f"model.path={tmp_path / 'missing'}", timeout=60)
    assert rc == 2 and time.monotonic() - t0 < 30, out
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1 and "model.path" in lines[0] and "no such directory" in lines[0], out


@pytest.mark.e2e
@pytest.mark.slow
def test_wrong_model_path_ends_the_mpi_job_at_once(tmp_path):
    """As launchers/gyre.sbatch starts it (no `gyre run` checked first): every rank refuses."""
    from gyre.cluster.local import find_mpiexec

    key = tmp_path / "key"
    key.write_text("k")
    key.chmod(0o600)
    t0 = time.monotonic()
    proc = subprocess.run([find_mpiexec(), "-n", "3", sys.executable, "-m", "gyre.cluster.main", "--engine-key-file",
                           str(key), "--config", str(ROOT / "launchers" / "demo.toml"), f"run.dir={tmp_path / 'r'}",
                           f"model.path={tmp_path / 'missing'}"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode != 0 and time.monotonic() - t0 < 30, proc.stderr
    assert "configuration error: model.path" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("process", ["head", "agent", "engine", "trainer"])
def test_a_process_that_dies_at_start_ends_the_job(tmp_path, process):
    faults = tmp_path / "faults"
    faults.mkdir()
    # one cell: a start-up death ends the job whatever the layout, and a second cell's processes
    # would only start to be killed
    rc, out = gyre_run(tmp_path / "r", "sched.cells=1", steps=1, timeout=240,
                       env={"GYRE_FAULT": f"{process}:start", "GYRE_FAULT_DIR": str(faults)})
    assert (faults / f"fired-{process}-start-1").exists(), out[-3000:]
    assert rc != 0, out[-3000:]
    if process in ("engine", "trainer"):  # the cell tells the head why, the head ends the job in one line
        said = [ln for ln in out.splitlines() if "the head (rank 0) failed: StartError" in ln]
        assert said and all("cannot start" in x for x in said), out[-3000:]
        # ... which `gyre run` names at the end even where mpiexec ended before forwarding the head's
        # own line (seen under load)
        end = [ln for ln in out.splitlines() if ln.startswith("gyre run: the job ended")]
        assert end and "the head (rank 0) failed: StartError" in end[-1] and process in end[-1], out[-3000:]
    assert "Traceback" not in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("what", ["missing", "family", "tokenizer"])
def test_gyre_rollout_model_errors_are_one_line(tmp_path, what):
    """`gyre rollout` with a model directory it cannot use: one line naming model.path, exit 2."""
    from gyre.config import default_tiny_dir, load_config
    from gyre.model.tiny import ensure_tiny_model

    model = tmp_path / "m"
    if what != "missing":
        model.mkdir()
        tiny = Path(ensure_tiny_model(default_tiny_dir(load_config(None, [])), "qwen2"))
        if what == "family":
            (model / "config.json").write_text('{"model_type": "gpt_bigcode"}')
        else:
            for f in [tiny / "config.json", *tiny.glob("*.safetensors")]:
                (model / f.name).write_bytes(f.read_bytes())
    proc = subprocess.run([sys.executable, "-m", "gyre.cli", "rollout", f"run.dir={tmp_path / 'r'}",
                           f"model.path={model}"], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "model.path" in lines[0], proc.stderr
    assert {"missing": "no such directory", "family": "not supported", "tokenizer": "no tokenizer.json"}[what] in lines[0]
