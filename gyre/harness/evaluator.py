"""Score a retained workspace the NL2RepoBench way.

Copy the workspace, delete packaging files (anywhere in the tree, NL2RepoBench's list) and the
paths of ``test_files.json``, add the task's tests, run ``test_commands.json`` in a subprocess with
one time limit for all of them, add up pytest's "N passed", score = min(passed / count, 1).

The execution's status only names the source: a timed-out or crashed harness left a workspace
that is scored exactly like a finished one (partial progress counts). Image-only tasks are
reported ``unscorable`` with a reward of None, never 0.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from gyre.harness import proc
from gyre.harness.tasks import Task

log = logging.getLogger(__name__)

# openhands/post_processor.py:remove_package_files in NL2RepoBench, matched by name at any depth.
PACKAGING_FILES = frozenset({
    "setup.py", "pyproject.toml", "setup.cfg", "requirements.txt", "requirements-dev.txt",
    "requirements-test.txt", "tox.ini", "pytest.ini", "poetry.lock", "Pipfile", "Pipfile.lock",
    "environment.yml", "conda-env.yaml", "manifest.in", "MANIFEST.in",
})
SOURCES = {"done": "tests", "failed": "tests", "timeout": "tests-after-timeout",
           "crashed": "tests-after-crash"}
_TAIL_BYTES = 256 << 10  # the pytest summary is at the end of a command's output
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected|warnings?)\b")
_SUMMARY_END = re.compile(r"\bin \d+(?:\.\d+)?s\b")


@dataclass
class Evaluation:
    reward: float | None  # None: not scorable here (see error)
    passed: int
    total: int
    source: str  # tests | tests-after-timeout | tests-after-crash | unscorable | eval-error
    duration_s: float
    log_path: str | None
    error: str | None = None


@dataclass
class EvalOptions:
    timeout_s: float = 300.0
    scratch_dir: str = ""  # empty: the system temp dir (outside any repository, so pytest's rootdir is the copy)
    keep_scratch: bool = False
    max_output_mb: int = 64
    remove_conftest: bool = False
    pass_env: tuple = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "USER", "LOGNAME", "TMPDIR")
    kill_grace_s: float = 2.0

    @classmethod
    def from_config(cls, cfg) -> "EvalOptions":
        """From a GyreConfig: its [eval] section plus the harness's environment allowlist."""
        e = cfg.eval
        return cls(timeout_s=e.timeout_s, scratch_dir=e.scratch_dir, keep_scratch=e.keep_scratch,
                   max_output_mb=e.max_output_mb, remove_conftest=e.remove_conftest,
                   pass_env=tuple(cfg.harness.pass_env))


def source_for(status: str) -> str:
    return SOURCES.get(status, f"tests-after-{status}")


def parse_pytest_summary(output: str) -> dict[str, int] | None:
    """Counts from the last pytest summary line ("3 passed, 1 failed in 0.12s"), or None."""
    for line in reversed(_ANSI.sub("", output).splitlines()):
        if _SUMMARY_END.search(line) and (_COUNT.search(line) or "no tests ran" in line):
            counts = {"passed": 0, "failed": 0, "errors": 0}
            for n, word in _COUNT.findall(line):
                key = "errors" if word.startswith("error") else word
                counts[key] = counts.get(key, 0) + int(n)
            return counts
    return None


# -- preparing the copy ------------------------------------------------------------------------

def _copy_regular(src: str, dst: str) -> None:
    # FIFOs, sockets and devices are skipped: opening a FIFO would block the evaluator forever.
    if stat.S_ISREG(os.lstat(src).st_mode):
        shutil.copy2(src, dst)


def _inside(path: Path, root: Path) -> bool:
    try:
        return path.resolve().is_relative_to(root)
    except (OSError, RuntimeError):  # a symlink loop
        return False


def _drop_escaping_links(repo: Path, notes: list[str]) -> None:
    """Remove symlinks leading outside the copy, so that deleting and adding test paths can only
    touch the copy, and the score depends on the workspace alone."""
    root = repo.resolve()
    for dirpath, dirnames, filenames in os.walk(repo):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            if p.is_symlink() and not _inside(p, root):
                p.unlink()
                notes.append(f"removed link leading outside the workspace: {p.relative_to(repo)}")


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _prepare(task: Task, workspace: Path, repo: Path, opts: EvalOptions, notes: list[str]) -> None:
    try:
        shutil.copytree(workspace, repo, symlinks=True, copy_function=_copy_regular)
    except shutil.Error as e:  # unreadable files: score what could be copied
        notes.append(f"some files could not be copied: {len(e.args[0])} errors")
        repo.mkdir(exist_ok=True)
    _drop_escaping_links(repo, notes)
    doomed = PACKAGING_FILES | ({"conftest.py"} if opts.remove_conftest else set())
    for dirpath, _, filenames in os.walk(repo):
        for name in filenames:
            if name in doomed:
                p = Path(dirpath) / name
                p.unlink()
                notes.append(f"removed packaging file {p.relative_to(repo)}")
    for rel in task.test_files:
        target = repo / rel
        if target.is_symlink() or target.exists():
            _remove(target)
            notes.append(f"removed candidate test path {rel}")
    for rel in task.test_files:
        src, dst = task.tests_dir / rel, repo / rel
        for parent in reversed(dst.relative_to(repo).parents[:-1]):  # a file where a folder goes
            p = repo / parent
            if p.is_symlink() or (p.exists() and not p.is_dir()):
                p.unlink()
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, dst)
        notes.append(f"added test path {rel}")


# -- running the commands ----------------------------------------------------------------------

def _read_tail(path: Path, start: int, end: int) -> str:
    begin = max(start, end - _TAIL_BYTES)
    with open(path, "rb") as f:
        f.seek(begin)
        return f.read(end - begin).decode("utf-8", "replace")


def _run_commands(task: Task, repo: Path, log_path: Path, opts: EvalOptions,
                  notes: list[str]) -> tuple[dict[str, int], bool]:
    env = proc.child_env(opts.pass_env, {"PYTHONPATH": str(repo), "PYTHONDONTWRITEBYTECODE": "1"})
    # `python` and `pytest` in the commands mean the interpreter Gyre runs under.
    env["PATH"] = os.pathsep.join(filter(None, [str(Path(sys.executable).parent), env.get("PATH")]))
    totals = {"passed": 0, "failed": 0, "errors": 0}
    deadline = time.monotonic() + opts.timeout_s
    timed_out = False
    for i, command in enumerate(task.test_commands):
        with open(log_path, "ab") as out:
            out.write(f"\n$ {command}\n".encode())
            out.flush()
            start = out.tell()
            argv = proc.with_limits(["/bin/sh", "-c", command], fsize_mb=opts.max_output_mb)
            child = subprocess.Popen(argv, cwd=repo, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = child.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                proc.kill_group(child.pid, signal.SIGTERM)
                try:
                    rc = child.wait(timeout=opts.kill_grace_s)
                except subprocess.TimeoutExpired:
                    proc.kill_group(child.pid, signal.SIGKILL)
                    rc = child.wait()
            proc.kill_group(child.pid, signal.SIGKILL)  # stragglers the command left behind
            end = out.tell()
            out.write(f"\n[exit status {rc}]\n".encode())
        counts = parse_pytest_summary(_read_tail(log_path, start, end))
        if counts is None:
            notes.append(f"command {i + 1}: no pytest summary in its output")
        else:
            for k in totals:
                totals[k] += counts.get(k, 0)
        if timed_out:
            notes.append(f"evaluation time limit of {opts.timeout_s:g}s reached in command {i + 1}; "
                         f"{len(task.test_commands) - i - 1} later commands not run")
            break
    return totals, timed_out


def evaluate_workspace(task: Task, workspace: str | os.PathLike, status: str = "done",
                       options: EvalOptions | None = None, log_path: str | os.PathLike | None = None
                       ) -> Evaluation:
    """Score ``workspace`` for ``task``; ``status`` is how the execution ended. Never raises:
    a failure of the evaluator itself is returned with source ``eval-error`` and reward None."""
    opts = options or EvalOptions()
    t0 = time.monotonic()
    if not task.scorable:
        return Evaluation(None, 0, task.test_case_count, "unscorable", 0.0, None, task.unscorable_reason())
    source = source_for(status)
    # absolute: the commands run inside the copy, where a relative PYTHONPATH would mean nothing
    scratch_root = (Path(opts.scratch_dir) if opts.scratch_dir else Path(tempfile.gettempdir())).absolute()
    scratch = None
    lp = Path(log_path) if log_path else None
    try:
        scratch_root.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f"gyre-eval-{task.name}-", dir=scratch_root))
        if lp is None:
            lp = scratch.with_suffix(".log")  # next to the scratch copy, kept after it is removed
        lp.parent.mkdir(parents=True, exist_ok=True)
        lp.write_text(f"task {task.name}\nworkspace {workspace}\nexecution status {status}\n"
                      f"scratch {scratch}\n", encoding="utf-8")
        ws = Path(workspace)
        if not ws.is_dir():
            raise FileNotFoundError(f"workspace {ws} does not exist")
        notes: list[str] = []
        repo = scratch / "repo"
        _prepare(task, ws, repo, opts, notes)
        with open(lp, "a", encoding="utf-8") as f:
            f.writelines(n + "\n" for n in notes)
        notes = [n for n in notes if not n.startswith(("removed", "added"))]
        totals, timed_out = _run_commands(task, repo, lp, opts, notes)
        passed = totals["passed"]
        reward = min(passed / task.test_case_count, 1.0)
        with open(lp, "a", encoding="utf-8") as f:
            f.write(f"\npassed {passed} failed {totals['failed']} errors {totals['errors']} "
                    f"of {task.test_case_count}: reward {reward:.4f} ({source})\n")
        return Evaluation(reward, passed, task.test_case_count, source, time.monotonic() - t0,
                          str(lp), "; ".join(notes) or None)
    except Exception as e:  # noqa: BLE001 - reported, never raised into the rollout
        log.exception("evaluation of %s in %s failed", task.name, workspace)
        return Evaluation(None, 0, task.test_case_count, "eval-error", time.monotonic() - t0,
                          str(lp) if lp else None, f"{type(e).__name__}: {e}")
    finally:
        if scratch is not None and not opts.keep_scratch:
            shutil.rmtree(scratch, ignore_errors=True)


# -- off the critical path ---------------------------------------------------------------------

@dataclass
class _Submitit:
    executor: object
    lock: threading.Lock = field(default_factory=threading.Lock)


class EvaluatorPool:
    """Evaluations run in worker threads (each one is a subprocess anyway), or as submitit jobs
    (``submitit-local`` here, ``submitit-slurm`` on a cluster) awaited by those threads, so at
    most ``workers`` are in flight either way."""

    def __init__(self, options: EvalOptions | None = None, workers: int = 2, executor: str = "pool",
                 submitit_dir: str | os.PathLike | None = None, slurm: dict | None = None):
        self.options = options or EvalOptions()
        self.kind = executor
        self._threads = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gyre-eval")
        self._submitit = None
        if executor != "pool":
            self._submitit = _Submitit(self._make_submitit(executor, submitit_dir, slurm or {}))

    @classmethod
    def from_config(cls, cfg) -> "EvaluatorPool":
        e = cfg.eval
        slurm = {"slurm_partition": e.slurm_partition, "cpus_per_task": e.slurm_cpus_per_task,
                 "mem_gb": e.slurm_mem_gb}
        folder = e.submitit_dir or str(Path(cfg.run.dir) / "eval-jobs")
        return cls(EvalOptions.from_config(cfg), e.workers, e.executor, folder, slurm)

    def _make_submitit(self, kind: str, folder, slurm: dict):
        import submitit  # only where asked for: a pool needs no submitit

        if kind not in ("submitit-local", "submitit-slurm"):
            raise ValueError(f"eval.executor: unknown executor {kind!r}")
        if folder is None:
            raise ValueError("a submitit executor needs a job folder")
        cluster = "local" if kind == "submitit-local" else "slurm"
        ex = submitit.AutoExecutor(folder=str(folder), cluster=cluster)
        params = {"timeout_min": max(1, int(self.options.timeout_s // 60) + 5), "name": "gyre-eval"}
        if cluster == "slurm":
            params.update(cpus_per_task=slurm.get("cpus_per_task", 2), mem_gb=slurm.get("mem_gb", 8))
            if slurm.get("slurm_partition"):
                params["slurm_partition"] = slurm["slurm_partition"]
        ex.update_parameters(**params)
        return ex

    def _run(self, task: Task, workspace: str, status: str, log_path: str | None) -> Evaluation:
        if self._submitit is None:
            return evaluate_workspace(task, workspace, status, self.options, log_path)
        t0 = time.monotonic()
        try:
            with self._submitit.lock:  # submitit's executors are not documented as thread-safe
                job = self._submitit.executor.submit(evaluate_workspace, task, str(workspace), status,
                                                     self.options, log_path)
            return job.result()
        except Exception as e:  # noqa: BLE001 - the job died (node failure, preemption, ...)
            return Evaluation(None, 0, task.test_case_count, "eval-error", time.monotonic() - t0,
                              log_path, f"submitit job failed: {type(e).__name__}: {e}")

    def submit(self, task: Task, workspace: str | os.PathLike, status: str = "done",
               log_path: str | os.PathLike | None = None) -> cf.Future:
        """A Future of the Evaluation; the call returns at once."""
        # absolute: a submitit job may start in another directory
        return self._threads.submit(self._run, task, str(Path(workspace).absolute()), status,
                                    str(Path(log_path).absolute()) if log_path else None)

    async def evaluate(self, task: Task, workspace: str | os.PathLike, status: str = "done",
                       log_path: str | os.PathLike | None = None) -> Evaluation:
        return await asyncio.wrap_future(self.submit(task, workspace, status, log_path))

    def shutdown(self, wait: bool = True, cancel_pending: bool = False) -> None:
        self._threads.shutdown(wait=wait, cancel_futures=cancel_pending)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
