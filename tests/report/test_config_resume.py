"""`gyre run --resume --config`: keys that may change apply; any other difference is refused,
naming the key (issue 45: the stored configuration was used silently)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gyre.config import ConfigError, load_config
from gyre.report import config_file

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "launchers" / "demo.toml"


def stored_run(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config_file.write(load_config(DEMO, [f"run.dir={run_dir}"]), run_dir)
    (run_dir / "state.json").write_text('{"version": 2, "groups_started": 4}')
    return run_dir


def changed(tmp_path: Path, old: str, new: str) -> Path:
    text = DEMO.read_text()
    assert old in text
    path = tmp_path / "changed.toml"
    path.write_text(text.replace(old, new))
    return path


def test_a_config_that_only_changes_what_may_change_is_applied(tmp_path):
    run_dir = stored_run(tmp_path)
    steps = load_config(DEMO).run.steps  # the demo's own, whatever it is
    cfg, used = config_file.resumed(run_dir, str(changed(tmp_path, f"steps = {steps}", f"steps = {steps + 6}")),
                                    [f"run.dir={run_dir}"])
    assert cfg.run.steps == steps + 6 and used == str(tmp_path / "changed.toml")
    cfg, used = config_file.resumed(run_dir, None, [f"run.dir={run_dir}", "run.steps=30"])
    assert cfg.run.steps == 30 and used == str(run_dir / "config.toml")  # no --config: the run's own


def test_a_config_that_changes_the_experiment_is_refused_naming_the_key(tmp_path):
    run_dir = stored_run(tmp_path)
    path = changed(tmp_path, "lr = 0.02", "lr = 0.05")
    with pytest.raises(ConfigError, match=r"train\.lr: 0\.02 in the run, 0\.05 in .*changed\.toml") as e:
        config_file.resumed(run_dir, str(path), [f"run.dir={run_dir}"])
    assert "run.steps" not in str(e.value).split("(only")[0]  # only the differing key is named
    # the command line: one line, exit 2, before any process starts
    proc = subprocess.run([sys.executable, "-m", "gyre.cli", "run", "--resume", "--config", str(path),
                           f"run.dir={run_dir}"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.lr" in lines[0] and "drop --config" in lines[0], proc.stderr
