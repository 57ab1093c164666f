"""Default per-harness limits (issue 24): processes, memory, stdout/stderr kept and workspace
bytes of one harness's whole tree, each stopping it with an error that names its [harness] key.
Real processes, bare on the host and (where installed) inside bubblewrap."""

from __future__ import annotations

import sys

import pytest

from gyre.config import HarnessConfig
from gyre.harness.limits import allocated_bytes, tree_usage, workspace_usage
from gyre.harness.runner import Limits
from support.harness_pool import MODES, pool, run

PY = sys.executable


def limits(**kw) -> Limits:
    return Limits(timeout_s=60, kill_grace_s=0.5, poll_s=0.1, **kw)


def test_defaults_come_from_harness_config():
    h = HarnessConfig()
    assert h.max_processes > 0 and h.max_memory_mb > 0 and h.max_log_mb > 0 and h.max_workspace_mb > 0


@pytest.mark.parametrize("mode", MODES)
def test_too_many_processes_stops_the_harness_naming_the_limit(tmp_path, mode):
    script = ("import subprocess, time\n"
              "ps = [subprocess.Popen(['sleep', '60']) for _ in range(40)]\n"
              "time.sleep(60)\n")
    res = run(pool(tmp_path, [PY, "-c", script], mode, limits=limits(max_processes=20)))
    assert res.status == "failed" and "harness.max_processes = 20" in res.error, res


@pytest.mark.parametrize("mode", MODES)
def test_too_much_memory_in_the_tree_stops_the_harness(tmp_path, mode):
    # four processes of 60 MB each: no one of them passes a per-process limit, the tree does
    script = ("import os, time\n"
              "for _ in range(3):\n"
              "    if os.fork() == 0: break\n"
              "b = bytearray(60 << 20)\n"
              "for i in range(0, len(b), 4096): b[i] = 1\n"
              "time.sleep(60)\n")
    res = run(pool(tmp_path, [PY, "-c", script], mode, limits=limits(max_memory_mb=150)))
    assert res.status == "failed" and "harness.max_memory_mb = 150" in res.error, res


def test_stdout_and_stderr_kept_are_capped(tmp_path):
    script = ("import sys\n"
              "for _ in range(48): sys.stdout.write('o' * 65536); sys.stderr.write('e' * 65536)\n"
              "print('end')\n")
    res = run(pool(tmp_path, [PY, "-c", script], limits=limits(max_log_mb=1)))
    assert res.status == "done", res  # a chatty harness is not stopped, only not kept whole
    for name in ("harness.stdout", "harness.stderr"):
        data = (tmp_path / "run" / "logs" / "e1" / name).read_bytes()
        assert len(data) < (1 << 20) + 200 and b"harness.max_log_mb" in data[-200:]
        assert data.startswith(b"o" * 100 if name.endswith("stdout") else b"e" * 100)


def test_small_output_is_kept_verbatim(tmp_path):
    res = run(pool(tmp_path, [PY, "-c", "import sys; print('hi'); sys.stderr.write('err')"],
                   limits=limits(max_log_mb=1)))
    logs = tmp_path / "run" / "logs" / "e1"
    assert res.status == "done" and (logs / "harness.stdout").read_bytes() == b"hi\n"
    assert (logs / "harness.stderr").read_bytes() == b"err"


@pytest.mark.parametrize("mode", MODES)
def test_workspace_over_its_limit_stops_the_harness(tmp_path, mode):
    script = ("import time\n"
              "for i in range(12): open(f'f{i}', 'wb').write(b'x' * (1 << 20))\n"
              "time.sleep(60)\n")
    res = run(pool(tmp_path, [PY, "-c", script], mode, limits=limits(max_workspace_mb=8)))
    assert res.status == "failed" and "harness.max_workspace_mb = 8" in res.error, res


@pytest.mark.parametrize("mode", MODES)
def test_many_empty_files_stop_the_harness_naming_the_limit(tmp_path, mode):
    # no bytes at all (max_workspace_mb never sees them), but each one an inode of the run directory
    script = ("import os, time\n"
              "os.mkdir('d')\n"
              "for i in range(400): open(f'd/f{i}', 'w').close()\n"
              "time.sleep(60)\n")
    res = run(pool(tmp_path, [PY, "-c", script], mode, limits=limits(max_workspace_files=300)))
    assert res.status == "failed" and res.error.startswith("harness.max_workspace_files = 300 passed"), res
    assert "more than 300 entries" in res.error and "raise it in [harness]" in res.error


def test_the_entry_count_stops_early_once_over_the_limit(tmp_path, monkeypatch):
    import os
    for d in range(5):
        (tmp_path / f"d{d}").mkdir()
        for i in range(50):
            (tmp_path / f"d{d}" / f"f{i}").touch()
    assert workspace_usage(tmp_path)[1] == 5 + 5 * 50  # folders and empty files each count
    seen = []
    real_scandir = os.scandir

    def counting_scandir(p):
        seen.append(p)
        return real_scandir(p)
    monkeypatch.setattr(os, "scandir", counting_scandir)
    used, n = workspace_usage(tmp_path, max_entries=20)
    assert n == 21 and len(seen) <= 2, seen  # stopped inside the first folder it entered


def test_one_file_larger_than_the_workspace_limit_cannot_be_written(tmp_path):
    script = "open('big', 'wb').write(b'x' * (9 << 20))\n"
    res = run(pool(tmp_path, [PY, "-c", script], limits=limits(max_workspace_mb=8)))
    assert res.status in ("crashed", "failed") and res.returncode != 0
    assert (tmp_path / "run" / "workspaces" / "e1" / "big").stat().st_size <= 8 << 20


def test_sparse_files_count_what_they_hold(tmp_path):
    f = tmp_path / "sparse"
    with open(f, "wb") as out:
        out.truncate(1 << 30)
        out.write(b"x" * 4096)
    assert allocated_bytes(tmp_path) < 1 << 20


def test_tree_usage_counts_descendants():
    import os
    n, rss = tree_usage(os.getpid())
    assert n >= 1 and rss > 0


def test_a_bind_to_its_own_path_is_mounted(tmp_path):
    from gyre.harness.sandbox import Environments, SandboxConfig
    d = tmp_path / "tools"
    d.mkdir()
    for spec in (f"{d}:{d}", str(d)):
        mounts, _ = Environments(SandboxConfig(sandbox="none", binds=(spec,)))._host_python_mounts()
        assert (str(d.resolve()), str(d.resolve())) in [(m.src, m.dst) for m in mounts], spec
    mounts, _ = Environments(SandboxConfig(sandbox="none", binds=(f"{d}:/opt/tools",)))._host_python_mounts()
    assert (str(d.resolve()), "/opt/tools") in [(m.src, m.dst) for m in mounts]


def test_the_sandbox_runs_the_interpreter_by_its_resolved_folder(tmp_path, monkeypatch):
    import sys
    from pathlib import Path

    from gyre.harness.sandbox import host_python
    real = tmp_path / "elsewhere" / "venv" / "bin"
    real.mkdir(parents=True)
    (real / "python").symlink_to(sys.executable)
    (tmp_path / ".venv").symlink_to(tmp_path / "elsewhere" / "venv")
    monkeypatch.setattr(sys, "executable", str(tmp_path / ".venv" / "bin" / "python"))
    assert host_python() == str(real.resolve() / "python")  # the folder resolved, not the link to the base
    assert Path(host_python()).parent == real.resolve()


def test_harnesses_that_cannot_start_are_infrastructure_and_break_the_pool(tmp_path):
    import asyncio

    from gyre.harness.runner import SandboxBroken
    from support.harness_pool import TASK
    script = "import sys; sys.stderr.write('bwrap: execvp /x/.venv/bin/python: No such file or directory\\n'); sys.exit(1)"
    p = pool(tmp_path, [PY, "-c", script], limits=limits())
    p.max_start_failures = 2
    first = run(p, "e1")
    assert first.status == "failed" and first.start_failure and "could not start in its sandbox: bwrap: execvp" in first.error
    run(p, "e2")
    assert p.broken and "2 harnesses in a row could not start" in p.broken and "bwrap: execvp" in p.broken
    with pytest.raises(SandboxBroken):
        asyncio.run(p.run_execution(TASK, "e3", api_key="k", base_url="http://127.0.0.1:9/v1"))
    ok = pool(tmp_path / "b", [PY, "-c", "import sys; sys.exit(1)"], limits=limits())
    assert not run(ok).start_failure  # an ordinary failure is the harness's, and scored
