"""The evaluator scores retained workspaces the NL2RepoBench way."""

import asyncio
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from gyre.harness.evaluator import (PACKAGING_FILES, EvalOptions, EvaluatorPool, evaluate_workspace,
                                    parse_pytest_summary)
from gyre.harness.tasks import load_suite, load_task
from support.eval_tasks import SOLUTIONS, TASKS, workspace


@pytest.fixture
def opts(tmp_path):
    return EvalOptions(timeout_s=60, scratch_dir=str(tmp_path / "scratch"))


@pytest.mark.parametrize("name", sorted(TASKS))
def test_reference_solution_scores_one(tmp_path, opts, name):
    ev = evaluate_workspace(TASKS[name], workspace(tmp_path, solution=name), "done", opts, tmp_path / "eval.log")
    assert (ev.reward, ev.passed, ev.total, ev.source) == (1.0, TASKS[name].test_case_count,
                                                           TASKS[name].test_case_count, "tests"), ev
    assert ev.error is None and ev.log_path == str(tmp_path / "eval.log")
    assert "passed" in Path(ev.log_path).read_text()
    assert not list((tmp_path / "scratch").iterdir()), "the scratch copy is removed"


def test_partial_solutions_score_partially(tmp_path, opts):
    roman = (SOLUTIONS / "roman" / "roman.py").read_text().split("_TABLE")[0]
    roman += "\ndef from_roman(s):\n    raise NotImplementedError\n"
    ev = evaluate_workspace(TASKS["roman"], workspace(tmp_path, {"roman.py": roman}), "done", opts)
    assert (ev.passed, ev.total) == (18, 44) and ev.reward == pytest.approx(18 / 44)
    literal_only = ("class PatternError(ValueError):\n    pass\n\n"
                    "def fullmatch(p, t):\n    return p == t\n\ndef search(p, t):\n    return p in t\n")
    ev = evaluate_workspace(TASKS["minire"], workspace(tmp_path / "m", {"minire.py": literal_only}), "done", opts)
    assert (ev.passed, ev.total) == (16, 49)


def test_passes_are_summed_over_commands(tmp_path, opts):
    ws = workspace(tmp_path, solution="kvstore")
    (ws / "kvstore" / "__main__.py").unlink()  # the store works, the command line does not
    ev = evaluate_workspace(TASKS["kvstore"], ws, "done", opts)
    assert len(TASKS["kvstore"].test_commands) == 2
    assert (ev.passed, ev.total) == (9, 14) and 0 < ev.reward < 1


def test_empty_workspace_scores_zero(tmp_path, opts):
    ev = evaluate_workspace(TASKS["fizzbuzz"], workspace(tmp_path), "failed", opts)
    assert (ev.reward, ev.passed, ev.source) == (0.0, 0, "tests")


# (the two other statuses, each one evaluation of the same solution: "done" -> "tests" in
# test_reference_solution_scores_one[fizzbuzz], "timeout" -> "tests-after-timeout" in test_submitit_local_executor)
@pytest.mark.parametrize("status,source", [("crashed", "tests-after-crash"), ("failed", "tests")])
def test_status_names_the_source_and_scores_alike(tmp_path, opts, status, source):
    ev = evaluate_workspace(TASKS["fizzbuzz"], workspace(tmp_path, solution="fizzbuzz"), status, opts)
    assert (ev.source, ev.reward) == (source, 1.0)


def test_image_only_task_is_unscorable_not_zero(tmp_path, opts):
    d = tmp_path / "suite" / "six"
    d.mkdir(parents=True)
    (d / "start.md").write_text("Implement six.")
    (d / "test_commands.json").write_text('["pip install -e .", "pytest test_six.py"]')
    (d / "test_case_count.txt").write_text("199")
    (d / "test_files.json").write_text('["test_six.py"]')
    (d.parent / "gyre-suite.json").write_text('{"image": "ghcr.io/multimodal-art-projection/nl2repobench/{task}:1.0"}')
    task = load_suite(d.parent)[0]
    ev = evaluate_workspace(task, workspace(tmp_path, {"six.py": "x = 1"}), "done", opts)
    assert ev.reward is None and ev.source == "unscorable" and ev.total == 199
    assert ev.error.startswith("cannot be scored here: needs image "
                                "ghcr.io/multimodal-art-projection/nl2repobench/six:1.0: harness.image_dir is not set")
    assert ev.official_reward == 0.0  # the benchmark counts it 0; Gyre's means leave it out


def test_packaging_and_candidate_tests_are_replaced(tmp_path, opts):
    # The candidate ships its own always-passing tests, a pytest.ini that would only collect them,
    # and packaging files: all go before the task's tests are added.
    files = {f"sub/{name}" if i % 2 else name: "" for i, name in enumerate(sorted(PACKAGING_FILES))}
    files.update({
        "pytest.ini": "[pytest]\naddopts = -k nothing_matches\n",
        "setup.py": "raise SystemExit('setup.py must not run')\n",
        "tests/test_fake.py": "import pytest\n\n@pytest.mark.parametrize('i', range(100))\n"
                              "def test_fake(i):\n    pass\n",
        "tests/conftest.py": "",
        "keep_me.py": "",
    })
    ws = workspace(tmp_path, files)
    ev = evaluate_workspace(TASKS["fizzbuzz"], ws, "done", opts, tmp_path / "eval.log")
    assert (ev.reward, ev.passed) == (0.0, 0), ev
    log = (tmp_path / "eval.log").read_text()
    for name in files:
        if name != "keep_me.py" and not name.startswith("tests/"):
            assert f"removed packaging file {name}" in log
    assert "removed candidate test path tests" in log and "added test path tests" in log
    assert "keep_me.py" not in log and (ws / "tests" / "test_fake.py").exists(), "the workspace itself is untouched"
    # The same workspace with a solution scores fully: only the task's 9 tests counted, not 100.
    (ws / "fizzbuzz.py").write_text((SOLUTIONS / "fizzbuzz" / "fizzbuzz.py").read_text())
    ev = evaluate_workspace(TASKS["fizzbuzz"], ws, "done", opts)
    assert (ev.reward, ev.passed) == (1.0, 9)


def test_hostile_workspace(tmp_path, opts):
    # A link out of the workspace where the tests go, a FIFO, and a link loop must neither touch
    # files outside nor hang the evaluator.
    outside = tmp_path / "outside"
    (outside / "tests").mkdir(parents=True)
    (outside / "tests" / "precious.txt").write_text("keep")
    ws = workspace(tmp_path, solution="fizzbuzz")
    os.symlink(outside / "tests", ws / "tests")
    os.symlink(outside, ws / "escape")
    os.symlink(ws / "loop", ws / "loop")
    os.mkfifo(ws / "pipe")
    t0 = time.monotonic()
    ev = evaluate_workspace(TASKS["fizzbuzz"], ws, "done", opts)
    assert time.monotonic() - t0 < 30
    assert ev.reward == 1.0, ev
    assert (outside / "tests" / "precious.txt").read_text() == "keep"


@pytest.mark.slow
def test_evaluation_time_limit_kills_the_tests(tmp_path):
    # the candidate leaves a child with a unique argument; it must not outlive the evaluation. The
    # child is watched for while the tests run: an evaluation whose limit came before the candidate
    # started it tested nothing, and is repeated once with 5 s (the limit this test used to wait
    # every time; 1.5 s is ample for the sandbox and pytest to import the candidate on a quiet machine)
    for limit_s in (1.5, 5.0):
        token = f"{time.time() % 1000:.6f}"
        ws = workspace(tmp_path / f"{limit_s:g}", {"fizzbuzz.py": "import subprocess, time\n"
                                                  f"subprocess.Popen(['sleep', '{token}'])\ntime.sleep(1000)\n"})
        seen: set[int] = set()
        done = threading.Event()

        def watch():
            while not done.is_set():
                seen.update(pids_with_arg(token))
                done.wait(0.05)
        watcher = threading.Thread(target=watch)
        watcher.start()
        t0 = time.monotonic()
        try:
            ev = evaluate_workspace(TASKS["fizzbuzz"], ws, "timeout",
                                    EvalOptions(timeout_s=limit_s, kill_grace_s=0.5, scratch_dir=str(tmp_path / "s")))
        finally:
            done.set()
            watcher.join()
        assert time.monotonic() - t0 < 15
        assert (ev.reward, ev.source) == (0.0, "tests-after-timeout")
        assert "time limit" in ev.error
        if seen:
            break
    assert seen, "the candidate's child never started within the limit"
    assert all(process_gone(pid) for pid in seen | set(pids_with_arg(token)))


def pids_with_arg(arg: str) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and arg.encode() in (p / "cmdline").read_bytes().split(b"\0"):
                out.append(int(p.name))
        except OSError:
            pass
    return out


def process_gone(pid: int, within_s: float = 5.0) -> bool:
    """Dead or a zombie (whoever adopted it may not have reaped it yet)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def test_missing_workspace_is_an_evaluator_error(tmp_path, opts):
    ev = evaluate_workspace(TASKS["fizzbuzz"], tmp_path / "gone", "done", opts)
    assert ev.reward is None and ev.source == "eval-error" and "does not exist" in ev.error


@pytest.mark.parametrize("text,expected", [
    ("....\n4 passed in 0.02s\n", {"passed": 4, "failed": 0, "errors": 0}),
    ("==== 1 failed, 2 passed, 1 skipped, 3 warnings in 1.20s ====", {"passed": 2, "failed": 1, "errors": 0}),
    ("\x1b[32m3 passed\x1b[0m, \x1b[31m2 errors\x1b[0m in 0.5s", {"passed": 3, "failed": 0, "errors": 2}),
    ("1 error in 0.05s", {"passed": 0, "failed": 0, "errors": 1}),
    ("no tests ran in 0.01s", {"passed": 0, "failed": 0, "errors": 0}),
    ("print says 7 passed\n2 passed, 1 failed in 0.1s\n", {"passed": 2, "failed": 1, "errors": 0}),
    ("==== 5 passed in 3.2s (0:00:03) ====", {"passed": 5, "failed": 0, "errors": 0}),
    ("Killed\n", None),
    ("", None),
])
def test_parse_pytest_summary(text, expected):
    counts = parse_pytest_summary(text)
    if expected is None:
        assert counts is None
    else:
        assert {k: counts[k] for k in expected} == expected


def test_pool_runs_off_the_critical_path(tmp_path, opts):
    with EvaluatorPool(opts, workers=2) as pool:
        futures = [pool.submit(TASKS[n], workspace(tmp_path / n, solution=n), "done") for n in ("fizzbuzz", "lru")]
        empty = pool.submit(TASKS["roman"], workspace(tmp_path / "e"), "crashed")
        assert [f.result(60).reward for f in futures] == [1.0, 1.0]
        assert (empty.result(60).reward, empty.result().source) == (0.0, "tests-after-crash")

        async def both():
            return await asyncio.gather(pool.evaluate(TASKS["lru"], workspace(tmp_path / "a", solution="lru")),
                                        pool.evaluate(TASKS["lru"], workspace(tmp_path / "b")))
        assert [e.reward for e in asyncio.run(both())] == [1.0, 0.0]


def test_submitit_local_executor(tmp_path, opts):
    pool = EvaluatorPool(opts, workers=1, executor="submitit-local", submitit_dir=tmp_path / "jobs")
    try:
        ev = pool.submit(TASKS["fizzbuzz"], workspace(tmp_path, solution="fizzbuzz"), "timeout",
                         tmp_path / "eval.log").result(120)
    finally:
        pool.shutdown()
    assert (ev.reward, ev.source) == (1.0, "tests-after-timeout"), ev
    assert any((tmp_path / "jobs").iterdir()), "the job ran through submitit"


def test_pool_from_config(tmp_path):
    from gyre.config import load_config

    cfg = load_config(None, [f"run.dir={tmp_path}", "eval.workers=3", "eval.timeout_s=9"])
    pool = EvaluatorPool.from_config(cfg)
    assert pool.kind == "pool" and pool.options.timeout_s == 9 and pool._threads._max_workers == 3
    pool.shutdown()
    assert load_task(TASKS["lru"].dir).name == "lru"


def test_relative_scratch_dir(tmp_path, monkeypatch):
    ws = workspace(tmp_path, solution="wordcount")
    monkeypatch.chdir(tmp_path)
    ev = evaluate_workspace(TASKS["wordcount"], "ws", "done", EvalOptions(scratch_dir="rel-scratch"))
    assert ev.reward == 1.0, ev
    assert Path(ev.log_path).is_absolute() and ws.is_dir()


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_task_commands_never_touch_gyres_environment(tmp_path, opts):
    # A task whose commands write into Gyre's site-packages and home, then run the tests without a
    # shell; in the task environment the writes fail, and scoring goes on.
    import site

    target = Path(site.getsitepackages()[0]) / f"gyre-touched-{tmp_path.name}.pth"
    home_target = Path.home() / f".gyre-touched-{tmp_path.name}"
    d = tmp_path / "suite" / "fb"
    shutil.copytree(TASKS["fizzbuzz"].dir, d)
    write = f"open({str(target)!r}, 'w').write('x'); open({str(home_target)!r}, 'w').write('x')"
    (d / "test_commands.json").write_text(json.dumps([f'python -c "{write}"', "pytest -q tests"]))
    task = load_task(d)
    try:
        ev = evaluate_workspace(task, workspace(tmp_path, solution="fizzbuzz"), "done", opts, tmp_path / "eval.log")
        assert ev.reward == 1.0, ev
        assert not target.exists() and not home_target.exists()
        assert "Read-only file system" in (tmp_path / "eval.log").read_text() or "No such file" in (tmp_path / "eval.log").read_text()
    finally:
        target.unlink(missing_ok=True)
        home_target.unlink(missing_ok=True)


def test_evaluator_refuses_anything_but_the_executions_own_workspace(tmp_path, opts, monkeypatch):
    """The bug this guards: an execution that never got a workspace ("" after its id was reused)
    was scored in the evaluator's current directory; from a folder holding a solution it scored
    1.0. Here the current directory holds a full fizzbuzz solution: no call may score it, copy it,
    or even make a scratch copy."""
    cwd = workspace(tmp_path / "cwd", solution="fizzbuzz")
    monkeypatch.chdir(cwd)
    root = tmp_path / "run" / "workspaces"
    own, other = root / "fizzbuzz-g0-a1", root / "fizzbuzz-g1-a0"
    for ws in (own, other):
        shutil.copytree(SOLUTIONS / "fizzbuzz", ws)
    with EvaluatorPool(opts, workers=1, workspaces_root=root) as pool:
        tries = {"empty": ("", "fizzbuzz-g0-a1"), "dot": (".", "fizzbuzz-g0-a1"),
                 "another's": (str(other), "fizzbuzz-g0-a1"), "missing": (str(own.parent / "x"), "x")}
        for what, (ws, eid) in tries.items():
            ev = pool.submit(TASKS["fizzbuzz"], ws, "done", execution_id=eid).result(60)
            assert (ev.reward, ev.source, ev.official_reward) == (None, "refused", 0.0), (what, ev)
            assert ev.error, what
        assert not Path(opts.scratch_dir).exists() or not any(Path(opts.scratch_dir).iterdir())
        ev = pool.submit(TASKS["fizzbuzz"], str(own), "done", execution_id="fizzbuzz-g0-a1").result(60)
        assert (ev.reward, ev.source) == (1.0, "tests")  # its own workspace is scored as ever
    for ws in ("", "."):  # the function itself refuses a path that means the current directory
        ev = evaluate_workspace(TASKS["fizzbuzz"], ws, "done", opts)
        assert (ev.reward, ev.source) == (None, "refused"), ws
