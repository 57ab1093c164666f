"""The evaluator against a hostile workspace and as NL2RepoBench's runner runs (issue 24): sparse
files stay sparse, FIFOs are skipped and the data copied is bounded by eval.max_copy_mb (an error
naming it); each command's own time limit; network and time cap per suite; an image's own ENV."""

from __future__ import annotations

import os

import pytest

from gyre.harness.evaluator import EvalOptions, evaluate_workspace
from gyre.harness.sparse_copy import CopyBudget, CopyBudgetExceeded
from support.eval_tasks import TASKS, workspace


def sparse(path, apparent: int, data: bytes, at: int) -> None:
    with open(path, "wb") as f:
        f.truncate(apparent)
        f.seek(at)
        f.write(data)


def test_sparse_file_is_copied_sparse_and_exact(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    sparse(src, 4 << 30, b"payload" * 512, 1 << 30)
    budget = CopyBudget(16 << 20)
    budget.copy(str(src), str(dst))
    st = os.stat(dst)
    assert st.st_size == 4 << 30 and st.st_blocks * 512 < 4 << 20  # 4 GB apparent, KBs on disk
    assert budget.copied < 1 << 20
    with open(dst, "rb") as f:
        f.seek(1 << 30)
        assert f.read(7 * 512) == b"payload" * 512
        f.seek(5)
        assert f.read(8) == b"\0" * 8


def test_copy_budget_names_its_key(tmp_path):
    for i in range(3):
        (tmp_path / f"f{i}").write_bytes(os.urandom(1 << 20))
    budget = CopyBudget(2 << 20)
    with pytest.raises(CopyBudgetExceeded, match="eval.max_copy_mb = 2"):
        for i in range(3):
            budget.copy(str(tmp_path / f"f{i}"), str(tmp_path / f"g{i}"))


def test_fifo_is_skipped(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    CopyBudget(0).copy(str(tmp_path / "fifo"), str(tmp_path / "copy"))
    assert not (tmp_path / "copy").exists()


def test_evaluation_of_a_sparse_workspace_scores_and_of_a_huge_one_fails_naming_the_limit(tmp_path):
    opts = EvalOptions(timeout_s=60, scratch_dir=str(tmp_path / "scratch"), max_copy_mb=4, keep_scratch=True)
    ws = workspace(tmp_path / "a", solution="fizzbuzz")
    sparse(ws / "blob.bin", 8 << 30, b"x" * 4096, 4 << 30)
    ev = evaluate_workspace(TASKS["fizzbuzz"], ws, "done", opts)
    assert ev.reward == 1.0, ev
    copied = next((tmp_path / "scratch").glob("gyre-eval-*/repo/blob.bin"))
    assert copied.stat().st_blocks * 512 < 1 << 20

    ws = workspace(tmp_path / "b", solution="fizzbuzz")
    (ws / "big.bin").write_bytes(os.urandom(5 << 20))
    ev = evaluate_workspace(TASKS["fizzbuzz"], ws, "done", opts)
    assert ev.reward is None and ev.source == "eval-error" and "eval.max_copy_mb = 4" in ev.error


def test_each_command_has_its_own_time_limit_and_the_next_still_runs(tmp_path):
    import json
    import sys

    from gyre.harness.sandbox_init import run_commands
    cmds = tmp_path / "commands.json"
    # the limit applies to each command alone: the second (a shell's echo, milliseconds) must finish
    # within it on a loaded machine too, hence a limit far above its cost (a Python start-up took
    # longer than 0.5 s under load; a shell's echo is a hundredth of that). The first waits it out.
    cmds.write_text(json.dumps([[sys.executable, "-c", "import time; time.sleep(60)"],
                                ["sh", "-c", "echo '== 2 passed in 0.1s =='"]]))
    run_commands(str(cmds), str(tmp_path), str(tmp_path), command_timeout=1.0)
    assert (tmp_path / "cmd-0.rc").read_text() == "-9"
    assert "eval.command_timeout_s = 1" in (tmp_path / "cmd-0.err").read_text()
    assert (tmp_path / "cmd-1.rc").read_text() == "0" and "2 passed" in (tmp_path / "cmd-1.out").read_text()


def test_evaluation_network_and_time_cap_follow_the_suite():
    from gyre.config import load_config
    from gyre.harness.evaluator import eval_network
    from gyre.harness.sandbox import Placement

    opts = EvalOptions.from_config(load_config(None, []))
    image, host = Placement("image", None, None, True, None), Placement("sandbox", None, None, True, None)
    assert eval_network(opts, image) and not eval_network(opts, host)  # NL2RepoBench's containers have it
    assert opts.image_timeout_s == 0 and opts.timeout_s == 300 and opts.command_timeout_s == 0
    opts.network = "off"
    assert not eval_network(opts, image)


def test_an_unpacked_image_keeps_its_own_env_under_bubblewrap(tmp_path):
    from gyre.harness.runtimes import ImageRef, get_runtime
    from gyre.harness.runtimes.image_env import SCRIPT, image_environment
    from gyre.harness.sandbox import Environments, Placement, SandboxConfig

    root = tmp_path / "six"
    (root / SCRIPT).parent.mkdir(parents=True)
    (root / SCRIPT).write_text('#!/bin/sh\nexport PATH="/opt/conda/bin:/usr/local/bin:/usr/bin:/bin"\n'
                               'export LANG="${LANG:-"C.UTF-8"}"\nexport QUOTED="a \\"b\\" \\$c"\n'
                               'echo not an export\n')
    assert image_environment(root) == {"PATH": "/opt/conda/bin:/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
                                       "QUOTED": 'a "b" $c'}
    assert image_environment(tmp_path / "none") == {}
    with pytest.warns(Warning):
        envs = Environments(SandboxConfig(sandbox="none"))
    place = Placement("image", get_runtime("bwrap"), ImageRef("bwrap", str(root), "six:1.0"), True, None)
    inst = envs.instance(place, ["true"], [], {"LANG": "en_US.UTF-8"}, name="t", private=[])
    assert inst.env["PATH"].startswith("/opt/conda/bin") and inst.env["LANG"] == "en_US.UTF-8"


def _deep_tree(root, depth: int) -> None:
    """``depth`` nested folders, built by fd so no path grows past PATH_MAX."""
    fd = os.open(root, os.O_RDONLY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            nxt = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = nxt
        with open(os.open("leaf.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "w") as f:
            f.write("deep")
    finally:
        os.close(fd)


def test_a_600_deep_tree_is_copied_for_scoring_and_the_copy_has_a_deadline(tmp_path):
    """Issue 34: a 600-deep tree made the evaluator's copytree raise RecursionError (reward NaN),
    and the copy had no time bound (200,000 files took 103 s)."""
    import time

    from gyre.harness.sparse_copy import CopyTimeExceeded, copy_tree

    ws = workspace(tmp_path / "a", solution="fizzbuzz")
    _deep_tree(ws, 600)
    opts = EvalOptions(timeout_s=120, scratch_dir=str(tmp_path / "scratch"))
    ev = evaluate_workspace(TASKS["fizzbuzz"], ws, "done", opts)
    assert ev.source == "tests" and ev.reward == 1.0, ev
    with pytest.raises(CopyTimeExceeded, match="eval.timeout_s"):
        copy_tree(ws, tmp_path / "late", CopyBudget(0).copy, deadline=time.monotonic() - 1)
    ev = evaluate_workspace(TASKS["fizzbuzz"], ws, "done", EvalOptions(timeout_s=1e-6, scratch_dir=str(tmp_path / "s2")))
    assert ev.reward is None and ev.source == "eval-error" and "eval.timeout_s" in ev.error, ev
