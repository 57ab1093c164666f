"""The `gyre` entry point and the typed configuration."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gyre.cli import COMMANDS, main
from gyre.config import ConfigError, load_config


def test_help_lists_every_subcommand(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_subcommand_has_help(name):
    # a subprocess: a subcommand's imports (torch, mpi4py, ...) must work from a clean interpreter
    r = subprocess.run([sys.executable, "-m", "gyre.cli", name, "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "usage: gyre" in r.stdout


def test_toml_file_and_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[engine]\nport = 31000\n[harness]\ncommand = ["a", "{prompt}"]\n[sched]\nscheme = "C"\n')
    cfg = load_config(f, ["engine.port=32000", "run.steps=3", "selection.role_priority=main,compactor"])
    assert cfg.engine.port == 32000 and cfg.run.steps == 3 and cfg.sched.scheme == "C"
    assert cfg.harness.command == ["a", "{prompt}"]
    assert cfg.selection.role_priority == ["main", "compactor"]


@pytest.mark.parametrize("text,needle", [
    ('[engine]\nport = -1\n', "engine.port: -1 is below the minimum 0"),
    ('[engine]\nbackend = "tgi"\n', "choose one of embedded, sglang, vllm"),
    ('[engine]\nprot = 1\n', "engine.prot: unknown key"),
    ('[enigne]\nport = 1\n', "enigne: unknown key"),
    ('[engine]\nport = "x"\n', "engine.port: expected int"),
    ('[engine\nport = 1\n', "not valid TOML"),
    ('engine = 3\n', "expected a table [engine]"),
])
def test_bad_config_names_key_value_and_what_is_allowed(tmp_path, text, needle):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=None) as e:
        load_config(f)
    assert needle in str(e.value)


def test_bad_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["port=3"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_cli_reports_config_errors_with_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "gyre.cli", "rollout", "engine.port=-5"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "engine.port: -5 is below the minimum 0" in r.stderr
