"""Run any command as one execution of a black-box harness.

Layout under the run directory (all folders 0700, private to the user):

    <run_dir>/workspaces/<execution_id>/   the harness's working directory, holding start.md
    <run_dir>/logs/<execution_id>/         harness.stdout, harness.stderr (the evaluator's log too)

The harness runs in its own sandbox (gyre.harness.sandbox: the task's image where one is found,
else bubblewrap on the host root; ``harness.sandbox = "none"`` opts out), in its own process
group (its sub-processes included), with the configured argv and environment. At the wall-clock limit the whole group gets SIGTERM, then SIGKILL after the
grace period. Workspaces are never deleted here except by ``cleanup_workspaces``.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import tempfile
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping, Sequence

from gyre.harness import proc
from gyre.harness.limits import CappedLog, TreeLimits, WorkspaceClock, check as check_limits
from gyre.harness.sandbox import (LIB, SOCKET, TASK, WORKSPACE, Environments, ProxyBridge, SandboxConfig,
                                  host_python, run_steps_async)
from gyre.harness.runtimes import Mount
from gyre.harness.tasks import Task
from gyre.traj.record import Status

INFRA_PREFIX = "cannot start the harness"  # the error of a try whose sandbox or process could not start
STATUSES = (Status.DONE, Status.FAILED, Status.CRASHED, Status.TIMEOUT, Status.STOPPED)  # a harness ends so
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_PLACEHOLDER = re.compile(r"\{(prompt|prompt_file|workspace|task_dir|python|execution_id|base_url)\}")
# Exit statuses a shell reports for a child killed by these signals (128 + N): still a crash.
_CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE,
                  signal.SIGKILL, signal.SIGXCPU}


# How a sandbox (bubblewrap) or Gyre's launchers say the harness could not even be started.
_START_FAILURE = re.compile(rb"^(bwrap: .*|gyre sandbox: cannot run .*|gyre: cannot run .*)$", re.M)


class SandboxBroken(RuntimeError):
    """Harnesses keep failing to start in their sandbox: an infrastructure failure, not a score."""


class WorkspaceExists(FileExistsError):
    """An execution id was reused: its workspace is kept, so a new execution needs a new id."""


@dataclass
class Limits:
    timeout_s: float = 600.0
    kill_grace_s: float = 5.0
    cpu_s: int = 0  # RLIMIT_CPU, 0 = none
    memory_mb: int = 0  # RLIMIT_AS of each process, 0 = none
    # the whole tree's (gyre.harness.limits), 0 = none; defaults from [harness]
    max_processes: int = 0
    max_memory_mb: int = 0
    max_log_mb: int = 0
    max_workspace_mb: int = 0
    poll_s: float = 1.0
    max_workspace_files: int = 0

    def tree(self) -> TreeLimits:
        return TreeLimits(self.max_processes, self.max_memory_mb, self.max_workspace_mb, self.max_workspace_files)


@dataclass
class ExecutionResult:
    execution_id: str
    task: str
    status: str  # done | failed | crashed | timeout | stopped
    returncode: int | None
    signal: str | None  # the signal that ended it, where one did
    started_at: float  # unix time
    duration_s: float
    workspace: str
    log_dir: str
    error: str | None = None
    start_failure: bool = False  # the harness never started (its sandbox or launcher said so)

    def to_dict(self) -> dict:
        return asdict(self)


def check_execution_id(execution_id: str) -> str:
    if not _ID.fullmatch(execution_id or ""):
        raise ValueError(f"execution id {execution_id!r}: use letters, digits, '.', '_' and '-' "
                         "(not starting with '.' or '-'), at most 200 characters")
    return execution_id


def private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)  # mkdir's mode is filtered by the umask; chmod is not
    return path


def workspace_path(run_dir: str | os.PathLike, execution_id: str) -> Path:
    return Path(run_dir) / "workspaces" / check_execution_id(execution_id)


def prepare_workspace(run_dir: str | os.PathLike, execution_id: str, task: Task) -> tuple[Path, Path]:
    """A fresh private workspace holding the task's start.md, and its log folder."""
    run = private_dir(Path(run_dir))
    ws = workspace_path(run, execution_id)
    private_dir(run / "workspaces")
    try:
        ws.mkdir(mode=0o700)
    except FileExistsError:
        raise WorkspaceExists(f"workspace {ws} exists; workspaces are kept, use a new execution id") from None
    os.chmod(ws, 0o700)
    if task.workspace_dir is not None:  # a dataset row's files (gyre.harness.datasets)
        shutil.copytree(task.workspace_dir, ws, dirs_exist_ok=True, symlinks=False)
    shutil.copyfile(task.prompt_file, ws / "start.md")
    logs = private_dir(run / "logs")
    return ws, private_dir(logs / execution_id)


PUBLIC_TASK_FILES = ("start.md", "test_commands.json", "test_case_count.txt", "test_files.json")


def public_task_dir(run_dir: str | os.PathLike, task: Task) -> Path:
    """What a harness may see of its task: the published files, never the hidden tests.

    GYRE_TASK_DIR points here rather than at the suite, so a policy with a shell cannot learn
    to copy the tests (or a reference solution) that will score it.
    """
    dst = private_dir(Path(run_dir) / "tasks") / task.name
    if not dst.is_dir():
        tmp = Path(tempfile.mkdtemp(prefix=f".{task.name}-", dir=dst.parent))
        for name in PUBLIC_TASK_FILES:
            if (task.dir / name).is_file():
                shutil.copyfile(task.dir / name, tmp / name)
        try:  # not fsio.atomic_dir: the first copy wins (the same files; remade if lost)
            os.rename(tmp, dst)
        except OSError:  # another execution of the same task won the race
            shutil.rmtree(tmp, ignore_errors=True)
    return dst


def expand_argv(command: Sequence[str], values: Mapping[str, str]) -> list[str]:
    """Replace the known ``{placeholders}``; other braces (JSON in an argument) stay as written."""
    if not command:
        raise ValueError("harness.command is empty")
    return [_PLACEHOLDER.sub(lambda m: values[m.group(1)], str(arg)) for arg in command]


def own_files(command: Sequence[str]) -> tuple[list[str], list[str]]:
    """(argv, the harness's own files): an argument of harness.command naming an existing file
    (``docs/recipes/openai_agent.py``, relative to where Gyre was started) becomes its absolute path,
    since a harness runs in its workspace; in a sandbox each such file is bound read-only at that
    path, so the documented recipes run as written. Folders are not bound (harness.sandbox_binds)."""
    argv, files = [], []
    for arg in command:
        text = str(arg)
        path = Path(text)
        if "{" not in text and not text.startswith("-") and path.is_file():
            text = str(path.resolve())
            files.append(text)
        argv.append(text)
    return argv, files


def classify(returncode: int | None, we_signalled: str | None) -> tuple[str, str | None]:
    """(status, signal name) from how the process ended and whether we killed it."""
    if returncode is None:
        return Status.FAILED, None
    if returncode < 0:
        name = proc.signal_name(-returncode)
        return (we_signalled, name) if we_signalled else (Status.CRASHED, name)
    if we_signalled:  # it caught our SIGTERM and exited by itself, or (through a sandbox) 128 + N
        return we_signalled, (proc.signal_name(returncode - 128) if returncode > 128 else None)
    if returncode == 0:
        return Status.DONE, None
    if returncode > 128 and (returncode - 128) in {int(s) for s in _CRASH_SIGNALS}:
        return Status.CRASHED, proc.signal_name(returncode - 128)
    return Status.FAILED, None


HARNESS_BROKE = "harness "  # the error of a harness that failed or crashed by itself: "harness exited 1; ..."
STDERR_EXCERPT = 300  # characters of the end of its stderr kept in that error (the log holds the rest)


def describe_failure(res: ExecutionResult, logs: Path) -> None:
    """A harness that failed or crashed by itself (no limit, no time limit, no start failure) gets
    an error that says how it ended and how its stderr ends, on one line, with the log's path:
    the summary and the ledger tell a harness bug from a bad answer."""
    if res.status not in (Status.FAILED, Status.CRASHED) or res.error or res.start_failure:
        return
    how = f"killed by {res.signal}" if res.signal else f"exited {res.returncode}"
    try:
        with open(logs / "harness.stderr", "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4 * STDERR_EXCERPT))
            tail = f.read().decode(errors="replace")
    except OSError:
        tail = ""
    tail = " | ".join(line.strip() for line in tail.strip().splitlines() if line.strip())[-STDERR_EXCERPT:]
    res.error = (f"{HARNESS_BROKE}{how}; stderr: {tail or '(empty)'} ({logs / 'harness.stderr'})")


TERM_REPEAT_S = 0.2  # a sandboxed harness is sent SIGTERM again this often during its grace period


class _Running:
    """One live execution, so that the pool can stop it."""

    def __init__(self, process: asyncio.subprocess.Process, sandboxed: bool = False, execution_id: str = ""):
        self.process, self.execution_id = process, execution_id
        # A sandbox ignores SIGTERM until its launcher is ready to pass it on (gyre.harness.sandbox):
        # a TERM that lands while it starts is lost, so it is repeated (the launcher passes on one).
        self.sandboxed = sandboxed
        self.reason: str | None = None  # "timeout", "stopped" or "failed" (a limit) once we signal it
        self.limit_error: str | None = None  # the [harness] limit it passed (or why it was ended early)
        self.done = asyncio.Event()

    async def terminate(self, reason: str, grace_s: float) -> None:
        if self.reason is None:
            self.reason = reason
        deadline = time.monotonic() + grace_s
        while True:
            proc.kill_group(self.process.pid, signal.SIGTERM)
            left = deadline - time.monotonic()
            try:
                await asyncio.wait_for(asyncio.shield(self.process.wait()),
                                       min(left, TERM_REPEAT_S) if self.sandboxed else left)
                break
            except asyncio.TimeoutError:
                if not self.sandboxed or time.monotonic() >= deadline:
                    break
        proc.kill_group(self.process.pid, signal.SIGKILL)


class HarnessPool:
    """Runs executions, at most ``concurrency`` at once, each as its own process group."""

    def __init__(self, run_dir: str | os.PathLike, command: Sequence[str], *, concurrency: int = 4,
                 limits: Limits | None = None, pass_env: Sequence[str] = ("PATH", "HOME", "LANG"),
                 extra_env: Mapping[str, str] | None = None, environments: Environments | None = None,
                 max_start_failures: int = 3):
        self.envs = environments or Environments(SandboxConfig())
        self.run_dir = Path(run_dir).absolute()  # the harness runs elsewhere: its paths must not be relative
        self.command, self.own_files = own_files(command)
        self.limits = limits or Limits()
        self.concurrency = concurrency
        self.pass_env = list(pass_env)
        self.extra_env = dict(extra_env or {})
        self._slots = asyncio.Semaphore(concurrency)
        self._running: set[_Running] = set()
        self._stopping = False
        self.max_running_seen = 0
        # consecutive harnesses that could not start: past max_start_failures the pool is broken
        self.max_start_failures = max_start_failures
        self.start_failures_in_a_row = 0
        self.broken: str | None = None

    @classmethod
    def from_config(cls, cfg, environments: Environments | None = None) -> "HarnessPool":
        h = cfg.harness
        limits = Limits(h.timeout_s, h.kill_grace_s, h.cpu_limit_s, h.memory_limit_mb, h.max_processes,
                        h.max_memory_mb, h.max_log_mb, h.max_workspace_mb, h.limits_poll_s,
                        h.max_workspace_files)
        return cls(cfg.run.dir, h.command, concurrency=h.concurrency, limits=limits,
                   pass_env=h.pass_env, extra_env=proc.parse_env_list(h.env),
                   environments=environments or Environments(SandboxConfig.from_config(h)),
                   max_start_failures=h.max_start_failures)

    @property
    def running(self) -> int:
        return len(self._running)

    async def run_execution(self, task: Task, execution_id: str, *, api_key: str, base_url: str,
                            extra_env: Mapping[str, str] | None = None) -> ExecutionResult:
        """Run one execution to its end and return how it ended. Raises WorkspaceExists for a reused
        id and RuntimeError once stop_all() was called; a harness that cannot even start is a
        ``failed`` execution with its error."""
        async with self._slots:
            if self.broken:
                raise SandboxBroken(self.broken)
            if self._stopping:
                raise RuntimeError("the harness pool is stopping; no new executions")
            ws, logs = prepare_workspace(self.run_dir, execution_id, task)
            res = await self._run(task, execution_id, ws, logs, api_key, base_url, extra_env or {})
            self._count_start(res, logs)
            describe_failure(res, logs)
            return res

    def _count_start(self, res: ExecutionResult, logs: Path) -> None:
        """A harness that cannot start in its sandbox is the infrastructure's failure: named as
        such, and a few in a row stop the pool with the sandbox's own message."""
        if res.status == Status.FAILED and not res.start_failure and res.returncode not in (None, 0):
            try:
                with open(logs / "harness.stderr", "rb") as f:
                    m = _START_FAILURE.search(f.read(1 << 16))
            except OSError:
                m = None
            if m:
                res.start_failure = True
                res.error = f"the harness could not start in its sandbox: {m.group(1).decode(errors='replace')}"
        if not res.start_failure:
            self.start_failures_in_a_row = 0
            return
        self.start_failures_in_a_row += 1
        if self.max_start_failures and self.start_failures_in_a_row >= self.max_start_failures and not self.broken:
            self.broken = (f"{self.start_failures_in_a_row} harnesses in a row could not start ({res.error}); "
                           "fix the sandbox or harness.command (harness.sandbox_binds for paths it needs) and resume")

    async def _run(self, task, execution_id, ws, logs, api_key, base_url, extra_env) -> ExecutionResult:
        task_dir = public_task_dir(self.run_dir, task)
        place = self.envs.place(task)
        lim = self.limits
        started, t0 = time.time(), time.monotonic()
        bridge, teardown, launch_env = None, [], {}

        def result(status, rc=None, sig=None, error=None):
            return ExecutionResult(execution_id, task.name, status, rc, sig, started,
                                   time.monotonic() - t0, str(ws), str(logs), error)

        env = proc.child_env(self.pass_env, {**self.extra_env, **extra_env})
        try:
            if place.kind == "host":  # harness.sandbox = none: host paths, Gyre's own user and namespaces
                values = {"prompt": task.prompt, "prompt_file": str(ws / "start.md"), "workspace": str(ws),
                          "task_dir": str(task_dir), "python": sys.executable, "execution_id": execution_id,
                          "base_url": base_url}
                env.update(OPENAI_BASE_URL=base_url, OPENAI_API_KEY=api_key, GYRE_WORKSPACE=str(ws),
                           GYRE_TASK_DIR=str(task_dir), GYRE_EXECUTION_ID=execution_id)
                argv = expand_argv(self.command, values)
            else:
                argv, env, bridge, teardown, launch_env = await self._sandboxed(
                    task, place, execution_id, ws, task_dir, api_key, base_url, env)
            argv = proc.with_limits(argv, cpu_s=lim.cpu_s, memory_mb=lim.memory_mb, fsize_mb=lim.max_workspace_mb)
            sinks = []
            try:  # through pipes, so that at most max_log_mb of each is kept
                for name in ("harness.stdout", "harness.stderr"):
                    r, w = os.pipe()
                    sinks.append((CappedLog(r, logs / name, lim.max_log_mb << 20), w))
                process = await asyncio.create_subprocess_exec(
                    *argv, cwd=ws, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=sinks[0][1],
                    stderr=sinks[1][1], start_new_session=True)
            except BaseException:
                for sink, w in sinks:
                    sink.close_unstarted()
                    os.close(w)
                raise
            for sink, w in sinks:
                os.close(w)
                sink.start()
        except (OSError, ValueError, RuntimeError) as e:  # not found, argv too long, bad command, runtime set-up
            await self._cleanup(bridge, teardown, launch_env)
            res = result(Status.FAILED, error=f"{INFRA_PREFIX}: {e}")
            res.start_failure = True
            return res
        try:
            return await self._wait(process, result, ws, sandboxed=place.kind != "host", execution_id=execution_id)
        finally:
            await asyncio.to_thread(lambda: [sink.finish() for sink, _ in sinks])
            await self._cleanup(bridge, teardown, launch_env)

    async def _sandboxed(self, task, place, execution_id, ws, task_dir, api_key, base_url, env):
        """argv and environment that run the harness inside its instance (see gyre.harness.sandbox)."""
        envs = self.envs
        envs.warn_unbounded(place, self.limits.max_processes)
        proxied = envs.config.network == "proxy" and place.runtime.restricts_network
        bridge = await ProxyBridge(base_url).start() if proxied else None
        inner_url = bridge.inner_url if bridge else base_url
        python = host_python() if place.kind == "sandbox" else envs.config.image_python
        values = {"prompt": task.prompt, "prompt_file": f"{WORKSPACE}/start.md", "workspace": WORKSPACE,
                  "task_dir": TASK, "python": python, "execution_id": execution_id, "base_url": inner_url}
        harness_argv = expand_argv(self.command, values)
        for k in ("PATH", "HOME", "TMPDIR", "SHELL") if place.kind == "image" else ("HOME", "TMPDIR"):
            env.pop(k, None)  # host paths mean nothing inside
        env.update(HOME="/tmp", OPENAI_BASE_URL=inner_url, OPENAI_API_KEY=api_key, GYRE_WORKSPACE=WORKSPACE,
                   GYRE_TASK_DIR=TASK, GYRE_EXECUTION_ID=execution_id,
                   PYTHONPATH=os.pathsep.join(filter(None, [LIB, env.get("PYTHONPATH")])))
        mounts = [Mount(str(ws), WORKSPACE, writable=True), Mount(str(task_dir), TASK)]
        if place.kind == "sandbox":  # an image has its own root: its files come with it
            mounts += [Mount(f, f) for f in self.own_files]  # the harness's own script, read-only
        # the kernel refuses a fork past the cap at once (where the runtime gives the instance a
        # user namespace of its own, or caps its pids itself); the poll stops the harness
        argv = envs.launcher(place, self.limits.max_processes)
        if bridge:
            mounts.append(Mount(str(bridge.path), SOCKET))
            argv += ["--forward", f"{bridge.inner_port}={SOCKET}"]
        argv += ["--", *harness_argv]
        inst = envs.instance(place, argv, mounts, env, name=execution_id, network=envs.config.network == "host",
                             private=[self.run_dir, task.dir.parent], max_processes=self.limits.max_processes)
        la = envs.launch(place, inst)
        try:
            await run_steps_async(la.setup, la.env, check=True)
        except Exception:
            if bridge:
                await bridge.close()
            raise
        return la.argv, la.env, bridge, la.teardown, la.env

    @staticmethod
    async def _cleanup(bridge, teardown, env) -> None:
        if teardown:
            await run_steps_async(teardown, env, check=False)
        if bridge is not None:
            await bridge.close()

    async def _wait(self, process, result, ws: Path | None = None, sandboxed: bool = False,
                    execution_id: str = "") -> ExecutionResult:
        lim = self.limits
        run = _Running(process, sandboxed, execution_id)
        self._running.add(run)
        self.max_running_seen = max(self.max_running_seen, len(self._running))
        watcher = asyncio.create_task(self._watch(run, ws)) if lim.tree().any() else None
        try:
            try:
                await asyncio.wait_for(asyncio.shield(process.wait()), lim.timeout_s)
            except asyncio.TimeoutError:
                await run.terminate(Status.TIMEOUT, lim.kill_grace_s)
            except asyncio.CancelledError:  # the caller gave up on it: leave nothing running
                await asyncio.shield(run.terminate(Status.STOPPED, lim.kill_grace_s))
                raise
            rc = await process.wait()
            if watcher is not None:
                watcher.cancel()
            proc.kill_group(process.pid, signal.SIGKILL)  # what it left running in its group
            status, sig = classify(rc, run.reason)
            error = run.limit_error or (f"wall-clock limit of {lim.timeout_s:g}s reached"
                                        if status == Status.TIMEOUT else None)
            return result(status, rc, sig, error)
        finally:
            if watcher is not None:
                watcher.cancel()
            self._running.discard(run)
            run.done.set()

    async def _watch(self, run: "_Running", ws: Path | None) -> None:
        """Stop the harness at the first [harness] limit its tree passes (gyre.harness.limits)."""
        lim = self.limits
        clock = WorkspaceClock(lim.poll_s)
        while run.process.returncode is None:
            walk = ws if clock.due_now() else None
            t0 = time.monotonic()
            error = await asyncio.to_thread(check_limits, lim.tree(), run.process.pid, walk)
            if walk is not None:
                clock.walked(time.monotonic() - t0)
            if error is not None and run.process.returncode is None:
                run.limit_error = error
                await run.terminate(Status.FAILED, 0.0)  # no grace: it is using what others need
                proc.kill_group(run.process.pid, signal.SIGKILL)
                return
            await asyncio.sleep(lim.poll_s)

    async def end_as_timeout(self, execution_id: str, why: str) -> bool:
        """End one running execution as its time limit would, e.g. once its token budget is spent
        (proxy.execution_token_budget). It was told why (its call was refused), so it first has
        `kill_grace_s` to end by itself, as an agent does on such an error; then SIGTERM, SIGKILL
        after `kill_grace_s` more, status ``timeout`` with error `why`. False when it is not
        running, ended by itself, or is being ended already."""
        run = next((r for r in self._running if r.execution_id == execution_id), None)
        if run is None:
            return False
        try:
            await asyncio.wait_for(asyncio.shield(run.process.wait()), self.limits.kill_grace_s)
            return False
        except asyncio.TimeoutError:
            pass
        if run.reason is not None or run.process.returncode is not None:
            return False
        run.limit_error = why
        await run.terminate(Status.TIMEOUT, self.limits.kill_grace_s)
        return True

    async def stop_all(self, grace_s: float | None = None) -> None:
        """Refuse new executions and end the running ones (SIGTERM, then SIGKILL after the grace
        period); their run_execution calls return with status ``stopped``."""
        self._stopping = True
        grace = self.limits.kill_grace_s if grace_s is None else grace_s
        runs = list(self._running)
        await asyncio.gather(*(r.terminate(Status.STOPPED, grace) for r in runs))
        await asyncio.gather(*(r.done.wait() for r in runs))

    def kill_all_now(self) -> None:
        """SIGKILL every running execution's group, synchronously (for a signal handler or atexit)."""
        self._stopping = True
        for r in list(self._running):
            r.reason = r.reason or Status.STOPPED
            proc.kill_group(r.process.pid, signal.SIGKILL)


def cleanup_workspaces(run_dir: str | os.PathLike, execution_ids: Sequence[str]) -> list[str]:
    """Delete the workspaces of the given executions (those whose shards are written), nothing
    else; returns the ids whose workspace was removed."""
    removed = []
    for eid in execution_ids:
        ws = workspace_path(run_dir, eid)
        if ws.is_dir() and not ws.is_symlink():
            shutil.rmtree(ws)
            removed.append(eid)
    return removed
