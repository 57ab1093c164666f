"""Score a retained workspace the NL2RepoBench way, in the task's environment.

The official post-processor (see gyre.harness.scoring): delete packaging files (anywhere in the
tree) and the paths of ``test_files.json`` from the candidate, put it over the task image's
``/workspace`` (which holds the hidden tests) in a fresh container, run each command of
``test_commands.json`` there without a shell, add up every "N passed" of the pytest commands,
score = min(passed / count, 1).

Here: for a task whose image is found locally, one instance of the image copies out its
``/workspace``, the cleaned candidate is laid over that copy, and a second, fresh instance runs
the commands in it. A task that ships its tests is scored the same way on the host root inside
bubblewrap, with the shipped tests added to the copy. Either way the commands never touch Gyre's
own environment (read-only mounts, a private /tmp, no network), and the node limits of the
harness bound them too: /tmp and /dev/shm of ``harness.tmpfs_mb``, and the kernel's process cap of
``harness.max_processes`` (``EvalOptions.max_processes``), so a hostile repository's tests cannot
fill the node's memory or fork-bomb it while they are scored.

Two scores come out. ``official_reward`` is the benchmark's: unscorable tasks and evaluator
failures count 0. ``reward`` is Gyre's training reward: None where nothing could be scored, and
its ``source`` says how the execution ended (a timed-out or crashed harness left a workspace that
is scored exactly like a finished one: ``tests-after-timeout``, ``tests-after-crash``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from gyre.config import EvalExecutor, EvalNetwork
from gyre.harness import proc, scoring
from gyre.harness.reward import RewardFn, call_summary, task_summary, tests_summary
from gyre.harness.runner import workspace_path
from gyre.harness.runtimes import Mount
from gyre.harness.sandbox import OUT, WORKSPACE, Environments, Placement, SandboxConfig, run_steps
from gyre.harness.sparse_copy import CopyBudget, copy_tree
from gyre.harness.tasks import Task
from gyre.traj.record import Status

log = logging.getLogger(__name__)

PACKAGING_FILES = scoring.PACKAGING_FILES
SOURCES = {Status.DONE: "tests", Status.FAILED: "tests", Status.TIMEOUT: "tests-after-timeout",
           Status.CRASHED: "tests-after-crash"}
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
    official_reward: float = 0.0  # the benchmark's score: unscorable and evaluator failures are 0
    environment: str = ""  # where the commands ran (runtime and image, or the host sandbox)
    parts: dict | None = None  # the named parts of a reward function's answer (gyre.harness.reward)


@dataclass
class EvalOptions:
    timeout_s: float = 300.0  # all commands of a task that ships its tests; 0 = none
    image_timeout_s: float = 0.0  # all commands of a task scored in its image (the official has none); 0 = none
    command_timeout_s: float = 0.0  # each command; 0 = none
    network: str = "auto"  # auto: on in a task's image (its commands install packages), off otherwise
    scratch_dir: str = ""  # empty: the system temp dir (outside any repository, so pytest's rootdir is the copy)
    keep_scratch: bool = False
    max_output_mb: int = 64
    max_copy_mb: int = 20480  # data of a workspace copied for scoring (0 = no limit)
    output: str = "official"  # what the scorer reads of each command (scoring.command_output)
    remove_conftest: bool = False
    pass_env: tuple = ("LANG", "LC_ALL", "TZ")
    kill_grace_s: float = 2.0
    # harness.max_processes: the test commands get the harness's kernel cap (2 x it + 160 tasks), so
    # a hostile repository's tests cannot fork-bomb the node while they are scored; 0 = none
    max_processes: int = 0
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    environments: Environments | None = None  # shared with the harness pool where there is one

    def envs(self) -> Environments:
        if self.environments is None:
            self.environments = Environments(self.sandbox)
        return self.environments

    @classmethod
    def from_config(cls, cfg, environments: Environments | None = None) -> "EvalOptions":
        """From a GyreConfig: its [eval] section plus the harness's sandbox settings."""
        e = cfg.eval
        sc = SandboxConfig.from_config(cfg.harness)
        return cls(timeout_s=e.timeout_s, image_timeout_s=e.image_timeout_s, command_timeout_s=e.command_timeout_s,
                   network=e.network, scratch_dir=e.scratch_dir, keep_scratch=e.keep_scratch,
                   max_output_mb=e.max_output_mb, max_copy_mb=e.max_copy_mb, output=e.output,
                   remove_conftest=e.remove_conftest, max_processes=cfg.harness.max_processes,
                   sandbox=sc, environments=environments)


def source_for(status: str) -> str:
    return SOURCES.get(status, f"tests-after-{status}")


_COLLECTION = re.compile(r"(ERROR collecting [^\n]*|errors? during collection|ImportError while importing test module[^\n]*)")
_told_uncollected: set[str] = set()


def collection_error(outputs: list) -> str:
    """pytest's own words where a test module could not be collected ("ERROR collecting tests/x.py"),
    or ""; such tests score as failed whatever the candidate did."""
    for out in outputs:
        m = _COLLECTION.search(_ANSI.sub("", str(out)))
        if m:
            return m.group(1).strip(" _")
    return ""


def warn_uncollected(task: str, what: str, log_path: str) -> None:
    """Once per task and process: the task's tests could not be collected (its score is 0 for a
    reason the policy cannot change: a broken task or a missing dependency)."""
    if task not in _told_uncollected:
        _told_uncollected.add(task)
        print(f"gyre: warning: task {task}: tests could not be collected ({what}); its executions score 0 "
              f"for it; see {log_path} and `gyre tasks`", file=sys.stderr, flush=True)


def parse_pytest_summary(output: str) -> dict[str, int] | None:
    """Counts from the last pytest summary line ("3 passed, 1 failed in 0.12s"), or None.
    Diagnostics only: the score follows the official rules (gyre.harness.scoring)."""
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
    CopyBudget(0).copy(src, dst)


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


def _clean_candidate(task: Task, workspace: Path, repo: Path, opts: EvalOptions, notes: list[str],
                     deadline: float | None = None) -> None:
    """The candidate as the official post-processor leaves it: packaging files and the task's test
    paths removed."""
    try:
        # sparse-aware and within eval.max_copy_mb: a workspace cannot fill the evaluator's disk;
        # without recursion (any depth) and within the evaluation's time
        copy_tree(workspace, repo, CopyBudget(opts.max_copy_mb << 20).copy, deadline)
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


def _add_shipped_tests(task: Task, repo: Path, notes: list[str]) -> None:
    for rel in task.test_files:
        src, dst = task.tests_dir / rel, repo / rel
        for parent in reversed(dst.relative_to(repo).parents[:-1]):  # a file where a folder goes
            p = repo / parent
            if p.is_symlink() or (p.exists() and not p.is_dir()):
                p.unlink()
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            # links kept as links (the suite reader refused any leading outside the task) and
            # dropped again below if they lead outside the copy
            shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, dst, follow_symlinks=False)
        notes.append(f"added test path {rel}")
    _drop_escaping_links(repo, notes)


def _overlay(src: Path, dst: Path) -> None:
    """``COPY workspace /workspace``: the candidate's files over the image's, candidate wins."""
    for dirpath, dirnames, filenames in os.walk(src):
        rel = Path(dirpath).relative_to(src)
        target_dir = dst / rel
        if target_dir.is_symlink() or (target_dir.exists() and not target_dir.is_dir()):
            target_dir.unlink()
        target_dir.mkdir(parents=True, exist_ok=True)
        for name in filenames + [d for d in dirnames if (Path(dirpath) / d).is_symlink()]:
            s, t = Path(dirpath) / name, target_dir / name
            if t.is_symlink() or t.is_file():
                t.unlink()
            elif t.is_dir():
                shutil.rmtree(t)
            if s.is_symlink():
                os.symlink(os.readlink(s), t)
            else:
                _copy_regular(str(s), str(t))


# -- running in the task environment -----------------------------------------------------------

class _Runner:
    """Instances of one task's environment for one evaluation."""

    def __init__(self, task: Task, place: Placement, envs: Environments, opts: EvalOptions, scratch: Path,
                 log_path: Path):
        self.task, self.place, self.envs, self.opts = task, place, envs, opts
        self.scratch, self.log_path = scratch, log_path
        self.n = 0

    def _env(self) -> dict[str, str]:
        env = proc.child_env(self.opts.pass_env, {"PYTHONPATH": WORKSPACE, "HOME": "/tmp",
                                                  "PYTHONDONTWRITEBYTECODE": "1"})
        return env

    def run(self, argv: list[str], mounts: list[Mount], timeout_s: float | None, workdir: str = WORKSPACE,
            network: bool = False) -> tuple[int | None, bool]:
        """(exit status, timed out) of ``argv`` (launcher arguments) in a fresh instance."""
        self.n += 1
        place, envs = self.place, self.envs
        env = self._env()
        if place.kind == "host":  # harness.sandbox = none: the instance's paths are host paths
            argv = [_to_host(a, mounts) for a in argv]
            workdir = _to_host(workdir, mounts)
            env["PYTHONPATH"] = _to_host(WORKSPACE, mounts)
            # `python` and `pytest` in the commands mean the interpreter Gyre runs under
            env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent),
                                           proc.child_env(("PATH",)).get("PATH", "/usr/bin:/bin")])
            env["HOME"] = str(self.scratch)
        cap = self.opts.max_processes
        inst = envs.instance(place, envs.launcher(place, cap) + argv, mounts, env,
                             name=f"eval-{self.task.name}-{os.getpid()}-{self.n}", private=[self.task.dir.parent],
                             network=network, workdir=workdir, max_processes=cap)
        la = envs.launch(place, inst)
        run_steps(la.setup, la.env, check=True)
        try:
            cmd = proc.with_limits(la.argv, fsize_mb=self.opts.max_output_mb)
            with open(self.log_path, "ab") as out:
                child = subprocess.Popen(cmd, cwd=self.scratch, env=la.env, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
                timed_out = False
                try:
                    rc = child.wait(timeout=None if timeout_s is None else max(0.0, timeout_s))
                except subprocess.TimeoutExpired:
                    timed_out = True
                    proc.kill_group(child.pid, signal.SIGTERM)
                    try:
                        rc = child.wait(timeout=self.opts.kill_grace_s)
                    except subprocess.TimeoutExpired:
                        proc.kill_group(child.pid, signal.SIGKILL)
                        rc = child.wait()
                proc.kill_group(child.pid, signal.SIGKILL)  # stragglers the commands left behind
            return rc, timed_out
        finally:
            run_steps(la.teardown, la.env, check=False)


def eval_network(opts: EvalOptions, place: Placement) -> bool:
    """Whether the test commands get the network: NL2RepoBench's containers have it (100 of its
    102 tasks start with ``pip install -e .``, which fetches build requirements), so a task
    scored in its image gets it under ``auto``; tests shipped with a suite run without."""
    return opts.network == EvalNetwork.ON or (opts.network == EvalNetwork.AUTO and place.kind == "image")


def _to_host(path: str, mounts: list[Mount]) -> str:
    for m in sorted(mounts, key=lambda m: -len(m.dst)):
        if path == m.dst or path.startswith(m.dst + "/"):
            return m.src + path[len(m.dst):]
    return path


def _read_output(path: Path, limit: int) -> str:
    if not path.exists():
        return ""
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", "replace")


def evaluate_workspace(task: Task, workspace: str | os.PathLike, status: str = "done",
                       options: EvalOptions | None = None, log_path: str | os.PathLike | None = None
                       ) -> Evaluation:
    """Score ``workspace`` for ``task``; ``status`` is how the execution ended. Never raises:
    a failure of the evaluator itself is returned with source ``eval-error``, reward None and an
    official reward of 0 (the benchmark's post-processing failure)."""
    opts = options or EvalOptions()
    t0 = time.monotonic()
    if not str(workspace) or _holds_cwd(Path(workspace)):
        # "" (an execution that never had a workspace) would mean the evaluator's own directory
        return refused(task, f"workspace {str(workspace)!r} is the evaluator's current directory "
                             f"(or holds it), not an execution's workspace")
    try:
        envs = opts.envs()
        place = envs.place(task)
    except Exception as e:  # noqa: BLE001 - a sandbox that cannot be used is this evaluation's error
        return Evaluation(None, 0, task.test_case_count, "eval-error", 0.0, None, f"{type(e).__name__}: {e}")
    if not place.scorable:
        return Evaluation(None, 0, task.test_case_count, "unscorable", 0.0, None,
                          f"cannot be scored here: {place.reason}", 0.0, place.label)
    envs.warn_unbounded(place, opts.max_processes)
    source = source_for(status)
    # absolute: the commands run inside the copy, where a relative path would mean nothing
    scratch_root = (Path(opts.scratch_dir) if opts.scratch_dir else Path(tempfile.gettempdir())).absolute()
    scratch = None
    lp = Path(log_path) if log_path else None
    try:
        scratch_root.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f"gyre-eval-{task.name}-", dir=scratch_root))
        os.chmod(scratch, 0o755)  # the instance's uid (not root) writes its outputs below
        if lp is None:
            lp = scratch.with_suffix(".log")  # next to the scratch copy, kept after it is removed
        lp.parent.mkdir(parents=True, exist_ok=True)
        lp.write_text(f"task {task.name}\nworkspace {workspace}\nexecution status {status}\n"
                      f"environment {place.label}\nscratch {scratch}\n", encoding="utf-8")
        ws = Path(workspace)
        if not ws.is_dir():
            raise FileNotFoundError(f"workspace {ws} does not exist")
        notes: list[str] = []
        repo, cand, out = scratch / "repo", scratch / "candidate", scratch / "out"
        out.mkdir()
        runner = _Runner(task, place, envs, opts, scratch, lp)
        cap = opts.image_timeout_s if place.kind == "image" else opts.timeout_s
        deadline = time.monotonic() + cap if cap > 0 else None
        left = lambda floor: None if deadline is None else max(floor, deadline - time.monotonic())  # noqa: E731
        network = eval_network(opts, place)
        _clean_candidate(task, ws, cand, opts, notes, deadline)
        _lay_out_repo(task, place, runner, scratch, cand, repo, notes, left(1.0) if place.kind == "image" else None)
        with open(lp, "a", encoding="utf-8") as f:
            f.writelines(n + "\n" for n in notes)
        notes = [n for n in notes if not n.startswith(("removed", "added", "candidate laid"))]
        # ... and the commands run in a fresh one, each without a shell, as the official runner does
        argvs = [scoring.split_command(c) for c in task.test_commands]
        (out / "commands.json").write_text(json.dumps(argvs))
        rc, timed_out = runner.run(["--commands", f"{OUT}/out/commands.json", "--out", f"{OUT}/out",
                                    "--workdir", WORKSPACE, "--command-timeout", str(opts.command_timeout_s)],
                                   [Mount(str(repo), WORKSPACE, True), Mount(str(scratch), OUT, True)],
                                   left(0.0), network=network)
        results, ran = _command_results(task, argvs, out, opts, lp)
        if timed_out:
            notes.append(f"evaluation time limit of {cap:g}s reached; "
                         f"{len(task.test_commands) - ran} commands not run")
        uncollected = collection_error([o for _, o in results])
        if uncollected:  # a 0 that says nothing about the candidate: tell it, once per task on the console
            notes.append(f"tests could not be collected: {uncollected}")
            warn_uncollected(task.name, uncollected, str(lp))
        counts = scoring.count_outputs(results, task.test_case_count)
        reward = counts.score
        with open(lp, "a", encoding="utf-8") as f:
            f.write(f"\npassed {counts.passed} failed {counts.failed} errors {counts.errors} "
                    f"of {task.test_case_count}: reward {reward:.4f} ({source})\n")
        return Evaluation(reward, counts.passed, task.test_case_count, source, time.monotonic() - t0,
                          str(lp), "; ".join(notes) or None, reward, place.label)
    except Exception as e:  # noqa: BLE001 - reported, never raised into the rollout
        log.exception("evaluation of %s in %s failed", task.name, workspace)
        return Evaluation(None, 0, task.test_case_count, "eval-error", time.monotonic() - t0,
                          str(lp) if lp else None, f"{type(e).__name__}: {e}", 0.0, place.label)
    finally:
        if scratch is not None and not opts.keep_scratch:
            shutil.rmtree(scratch, ignore_errors=True)


def _lay_out_repo(task: Task, place, runner: "_Runner", scratch: Path, cand: Path, repo: Path, notes: list[str],
                  copy_s: float | None) -> None:
    """The repository the commands run in: for an image, its /workspace (its hidden tests) copied
    out by one instance within `copy_s` seconds and the candidate laid over it; else the candidate
    with the task's shipped tests added."""
    if place.kind == "image":
        # the image's /workspace (its hidden tests), copied out by one instance ...
        rc, timed_out = runner.run(["--copy-tree", WORKSPACE, f"{OUT}/repo"], [Mount(str(scratch), OUT, True)],
                                   copy_s, workdir="/")
        if rc != 0 or timed_out or not repo.is_dir():
            raise RuntimeError(f"could not copy /workspace out of {place.image.location} (exit {rc})")
        _overlay(cand, repo)
        notes.append("candidate laid over the image's /workspace")
    else:
        cand.rename(repo)  # a scratch copy moved, nothing durable: no fsio
        _add_shipped_tests(task, repo, notes)


def _command_results(task: Task, argvs: list, out: Path, opts: EvalOptions, lp: Path) -> tuple[list, int]:
    """(command, output) of each test command that ran (in part), and their number; every
    command's output and exit status go to the log."""
    limit = opts.max_output_mb << 20
    results, ran = [], 0
    with open(lp, "a", encoding="utf-8") as f:
        for i, command in enumerate(task.test_commands):
            stdout = _read_output(out / f"cmd-{i}.out", limit)
            stderr = _read_output(out / f"cmd-{i}.err", limit)
            done = (out / f"cmd-{i}.rc").exists()
            rc_i = (out / f"cmd-{i}.rc").read_text().strip() if done else "not finished"
            if done or stdout or stderr:
                ran += 1
                code = int(rc_i) if rc_i.lstrip("-").isdigit() else None  # None: cut by the time limit
                results.append((command, scoring.command_output(argvs[i], code, stdout, stderr, opts.output)))
            f.write(f"\n$ {command}\n{stdout}\n[stderr]\n{stderr}\n[exit status {rc_i}]\n")
    return results, ran


def rewarded(reward, task: Task, workspace: str, ev: Evaluation, calls: list, execution_id: str) -> Evaluation:
    """The tests' evaluation re-scored by ``reward`` (gyre.harness.reward.RewardFn): its value, its
    parts, and a source saying so (``reward``, ``reward-after-timeout``, ...); a reward that fails
    makes a failed evaluation (``reward-error``, reward None) with its reason, never a 0."""
    payload = {"workspace": str(workspace), "task": task_summary(task), "tests": tests_summary(ev) if task.test_commands else None,
               "calls": [call_summary(c) for c in calls], "execution_id": execution_id}
    res = reward(payload, execution_id)
    if ev.log_path:
        with contextlib.suppress(OSError), open(ev.log_path, "a", encoding="utf-8") as f:
            f.write(f"reward {reward.label}: {res.reward} parts {res.parts} error {res.error}\n")
    if res.error is not None:
        return dataclasses.replace(ev, reward=None, source="reward-error", error=res.error, parts=None)
    source = "reward" + ev.source[len("tests"):] if ev.source.startswith("tests") else "reward"
    return dataclasses.replace(ev, reward=res.reward, source=source, parts=res.parts or None)


def _holds_cwd(path: Path) -> bool:
    cwd = Path.cwd().resolve()
    target = path.resolve()
    return target == cwd or target in cwd.parents


def refused(task: Task, why: str) -> Evaluation:
    """Not scored at all: what was asked to be scored is not the execution's own workspace."""
    return Evaluation(None, 0, task.test_case_count, "refused", 0.0, None, why)


def own_workspace_error(workspace: str | os.PathLike, root: Path | None, execution_id: str | None) -> str | None:
    """Why ``workspace`` is not the workspace of ``execution_id`` under ``root`` (None: it is).

    The evaluator scores nothing else: not an empty path (the current directory), not another
    execution's workspace, not a directory that is not there."""
    if not str(workspace):
        return "no workspace given (the execution never had one)"
    ws = Path(workspace)
    if not ws.is_absolute():
        return f"workspace {str(workspace)!r} is relative: it would be resolved against the evaluator's directory"
    if root is not None and execution_id is not None:

        want = workspace_path(root.parent, execution_id)
        if os.path.realpath(ws) != os.path.realpath(want):
            return f"workspace {ws} is not execution {execution_id}'s own ({want})"
    if not ws.is_dir():
        return f"workspace {ws} does not exist"
    return None


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
                 submitit_dir: str | os.PathLike | None = None, slurm: dict | None = None,
                 workspaces_root: str | os.PathLike | None = None, reward=None):
        """``reward``: a gyre.harness.reward.RewardFn that scores after the tests (None: the tests' score)."""
        self.options = options or EvalOptions()
        self.reward = reward
        # <run_dir>/workspaces: an execution's workspace must be its own folder there
        self.workspaces_root = Path(workspaces_root).absolute() if workspaces_root else None
        self.kind = executor
        self._threads = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gyre-eval")
        self._submitit = None
        if executor != EvalExecutor.POOL:
            self._submitit = _Submitit(self._make_submitit(executor, submitit_dir, slurm or {}))

    @classmethod
    def from_config(cls, cfg, environments: Environments | None = None) -> "EvaluatorPool":
        e = cfg.eval
        slurm = {"slurm_partition": e.slurm_partition, "cpus_per_task": e.slurm_cpus_per_task,
                 "mem_gb": e.slurm_mem_gb}
        folder = e.submitit_dir or str(Path(cfg.run.dir) / "eval-jobs")
        return cls(EvalOptions.from_config(cfg, environments), e.workers, e.executor, folder, slurm,
                   workspaces_root=Path(cfg.run.dir) / "workspaces", reward=RewardFn.from_config(cfg, environments))

    def _make_submitit(self, kind: str, folder, slurm: dict):
        import submitit  # only where asked for: a pool needs no submitit

        if kind not in ("submitit-local", "submitit-slurm"):
            raise ValueError(f"eval.executor: unknown executor {kind!r}")
        if folder is None:
            raise ValueError("a submitit executor needs a job folder")
        cluster = "local" if kind == "submitit-local" else "slurm"
        ex = submitit.AutoExecutor(folder=str(folder), cluster=cluster)
        cap = max(self.options.timeout_s, self.options.image_timeout_s)
        params = {"timeout_min": max(1, int(cap // 60) + 5) if cap > 0 else 24 * 60, "name": "gyre-eval"}
        if cluster == "slurm":
            params.update(cpus_per_task=slurm.get("cpus_per_task", 2), mem_gb=slurm.get("mem_gb", 8))
            if slurm.get("slurm_partition"):
                params["slurm_partition"] = slurm["slurm_partition"]
        ex.update_parameters(**params)
        return ex

    def _run(self, task: Task, workspace: str, status: str, log_path: str | None, calls=None,
             execution_id: str | None = None) -> Evaluation:
        if self.reward is not None and not task.test_commands:  # a dataset row scored by the reward alone
            ev = Evaluation(None, 0, 0, source_for(status), 0.0, log_path)
        else:
            ev = self._run_tests(task, workspace, status, log_path)
        if self.reward is None or ev.source == "refused":
            return ev
        return rewarded(self.reward, task, workspace, ev, calls or [], execution_id or "")

    def _run_tests(self, task: Task, workspace: str, status: str, log_path: str | None) -> Evaluation:
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
               log_path: str | os.PathLike | None = None, execution_id: str | None = None,
               calls: list | None = None) -> cf.Future:
        """A Future of the Evaluation; the call returns at once. With ``execution_id`` (and a
        pool made from a config) only that execution's own workspace is scored."""
        why = own_workspace_error(workspace, self.workspaces_root, execution_id) \
            if execution_id is not None or not str(workspace) else None
        if why is not None:
            fut: cf.Future = cf.Future()
            fut.set_result(refused(task, why))
            return fut
        # absolute: a submitit job may start in another directory
        return self._threads.submit(self._run, task, str(Path(workspace).absolute()), status,
                                    str(Path(log_path).absolute()) if log_path else None, calls, execution_id)

    async def evaluate(self, task: Task, workspace: str | os.PathLike, status: str = "done",
                       log_path: str | os.PathLike | None = None, execution_id: str | None = None,
                       calls: list | None = None) -> Evaluation:
        """``calls``: the execution's recorded calls (what a reward function is given of them)."""
        return await asyncio.wrap_future(self.submit(task, workspace, status, log_path, execution_id, calls))

    def shutdown(self, wait: bool = True, cancel_pending: bool = False) -> None:
        self._threads.shutdown(wait=wait, cancel_futures=cancel_pending)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
