"""A harness pool over the builtin fizzbuzz task, with and without a sandbox, for the runner tests."""

from __future__ import annotations

import asyncio
import shutil
import sys

import pytest

from gyre.harness.runner import HarnessPool, Limits
from gyre.harness.sandbox import Environments, SandboxConfig, UnsandboxedWarning
from gyre.harness.tasks import load_suite


TASK = {t.name: t for t in load_suite("builtin")}["fizzbuzz"]
PY = sys.executable
MODES = ["none", pytest.param("auto", marks=pytest.mark.skipif(shutil.which("bwrap") is None,
                                                               reason="bubblewrap is not installed"))]


def envs(mode: str) -> Environments:
    if mode != "none":
        return Environments(SandboxConfig(sandbox=mode))
    with pytest.warns(UnsandboxedWarning):
        return Environments(SandboxConfig(sandbox="none"))


def pool(tmp_path, command, mode="none", **kw):
    limits = kw.pop("limits", Limits(timeout_s=30, kill_grace_s=0.5))
    return HarnessPool(tmp_path / "run", command, limits=limits, environments=envs(mode), **kw)


def run(p: HarnessPool, eid="e1", task=TASK, **kw):
    return asyncio.run(p.run_execution(task, eid, api_key="key-" + eid, base_url="http://127.0.0.1:9/v1", **kw))
