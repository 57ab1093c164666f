"""Limits that bound the node inside bubblewrap (issue 34): sized tmpfs scratch, nothing else
writable in memory, and the kernel's process cap in the sandbox's own user namespace."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from gyre.harness.limits import kernel_counts_per_namespace, kernel_process_cap
from gyre.harness.runner import HarnessPool, Limits
from gyre.harness.sandbox import Environments, SandboxConfig
from support.harness_pool import TASK, run
from support.node_limits import FILL, fork_bomb

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
PY = sys.executable


def sized_pool(tmp_path, command: list[str], tmpfs_mb: int, **limits) -> HarnessPool:
    return HarnessPool(tmp_path / "run", command, limits=Limits(timeout_s=60, kill_grace_s=0.5, **limits),
                       environments=Environments(SandboxConfig(sandbox="bwrap", tmpfs_mb=tmpfs_mb)))


def test_tmp_and_dev_shm_are_sized_and_the_rest_is_read_only(tmp_path):
    p = sized_pool(tmp_path, [PY, "-c", FILL, "/tmp", "/dev/shm", "/", "/run", "/dev"], tmpfs_mb=4)

    async def both():
        hostile = p.run_execution(TASK, "e1", api_key="k1", base_url="http://127.0.0.1:9/v1")
        sibling = p.run_execution(TASK, "e2", api_key="k2", base_url="http://127.0.0.1:9/v1")
        return await asyncio.gather(hostile, sibling)

    res = asyncio.run(both())
    assert all(r.status == "done" for r in res), res
    got = json.loads((tmp_path / "run" / "workspaces" / "e1" / "fill.json").read_text())
    for scratch in ("/tmp", "/dev/shm"):  # full at its size, not at the node's memory
        n, err = got[scratch]
        assert err == "ENOSPC" and 3 << 20 <= n <= 4 << 20, (scratch, got)
    for ro in ("/", "/run", "/dev"):  # bwrap's other tmpfs mounts hold nothing
        assert got[ro] == [0, "EROFS"], (ro, got)
    # the sibling ran beside it with scratch of its own, as large as its own limit
    sib = json.loads((tmp_path / "run" / "workspaces" / "e2" / "fill.json").read_text())
    assert sib["/tmp"][1] == "ENOSPC" and sib["/tmp"][0] >= 3 << 20, sib


def test_unsized_tmpfs_is_the_old_behaviour(tmp_path):
    # tmpfs_mb = 0: /tmp takes what it is given (8 MB written whole)
    script = ("import os\nwith open('/tmp/f', 'wb') as f: f.write(b'x' * (8 << 20))\n")
    res = run(sized_pool(tmp_path, [PY, "-c", script], tmpfs_mb=0))
    assert res.status == "done", res


@pytest.mark.skipif(not kernel_counts_per_namespace(), reason="RLIMIT_NPROC per user namespace needs Linux 5.14")
def test_a_fork_bomb_is_capped_by_the_kernel_and_stopped_by_the_poll():
    with tempfile.TemporaryDirectory(prefix="gyre-forkbomb-") as tmp:  # pytest's own is private to root
        got = fork_bomb(Path(tmp), 50)
    if "skipped" in got:
        pytest.skip(got["skipped"])
    assert got["status"] == "failed" and got["error"].startswith("harness.max_processes = 50 passed"), got
    # the kernel refused forks past its cap at once (before it: 1,000+ in the poll's one second);
    # the wrapper and bwrap's outer process are the only ones outside the sandbox's namespace
    assert got["peak_processes"] <= kernel_process_cap(50) + 2, got
