"""Say it before running (issue 24): `gyre rollout` and `gyre run` refuse a suite with no task
that can be scored here, naming the reasons, and warn under a threshold share."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gyre.config import ConfigError, load_config
from gyre.harness.execute import check_scorable
from gyre.harness.sandbox import Environments, SandboxConfig
from gyre.harness.tasks import load_suite
from gyre.offline_rollout import Rollout, RolloutSummary, print_summary


def image_only_suite(root, names):
    for name in names:
        d = root / name
        d.mkdir(parents=True)
        (d / "start.md").write_text(f"Implement {name}.")
        (d / "test_commands.json").write_text(f'["pytest test_{name}.py"]')
        (d / "test_case_count.txt").write_text("3")
        (d / "test_files.json").write_text(f'["test_{name}.py"]')
    (root / "gyre-suite.json").write_text('{"image": "example.org/nl2repo/{task}:1.0"}')
    return root


def envs():
    with pytest.warns(Warning):
        return Environments(SandboxConfig(sandbox="none"))


def test_suite_with_nothing_scorable_is_refused_naming_why(tmp_path):
    tasks = load_suite(image_only_suite(tmp_path / "suite", ["six", "seven"]))
    with pytest.raises(ConfigError) as e:
        check_scorable(tasks, envs())
    msg = str(e.value)
    assert "none of its 2 tasks can be scored here" in msg and "six: needs image example.org/nl2repo/six:1.0" in msg
    assert "harness.image_dir" in msg


def test_few_scorable_tasks_warn_and_are_listed(tmp_path, caplog):
    tasks = load_suite(image_only_suite(tmp_path / "suite", ["six", "seven"])) + load_suite("builtin")[:1]
    with caplog.at_level(logging.WARNING, logger="gyre.execute"):
        out = check_scorable(tasks, envs(), min_share=0.5)
    assert set(out) == {"six", "seven"} and "only 1 of 3 tasks can be scored" in caplog.text
    assert check_scorable(load_suite("builtin"), envs()) == {}


def test_rollout_refuses_before_starting_anything(tmp_path):
    suite = image_only_suite(tmp_path / "suite", ["six"])
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", f"harness.suite={suite}", "harness.sandbox=none"])
    with pytest.warns(Warning), pytest.raises(ConfigError, match="none of its 1 tasks"):
        asyncio.run(Rollout(cfg, progress=False).run())
    assert not (tmp_path / "run" / "shards").exists() or not any((tmp_path / "run" / "shards").iterdir())


def test_summary_names_unscorable_tasks_and_reasons(capsys):
    s = RolloutSummary(unscorable=2, unscorable_tasks={"six": "needs image x"},
                       unscorable_reasons={"needs image x": 2})
    print_summary(s, load_config(None, []))
    out = capsys.readouterr().out
    assert "0 scored, 1 unscorable here" in out and "six: needs image x" in out and "2 x needs image x" in out


def test_test_count_is_read_as_the_official_reader_does(tmp_path):
    import os

    root = image_only_suite(tmp_path / "suite", ["six"])
    (root / "six" / "count.txt").write_text("7")
    first = [f for f in os.listdir(root / "six") if f.endswith(".txt")][0]
    task = load_suite(root)[0]
    assert task.test_case_count == (7 if first == "count.txt" else 3)  # the first *.txt os.listdir gives
    (root / "six" / "count.txt").write_text("seven")
    if first == "count.txt":
        with pytest.raises(ConfigError, match="first \\*.txt"):
            load_suite(root, strict=True)
