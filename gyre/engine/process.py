"""Engine processes: start one, watch it, stop it.

:func:`start_engine` runs ``python -m gyre.engine.cli`` (the embedded engine) as a subprocess and
returns once it printed its ``GYRE_ENGINE_LISTENING`` line (tests and benchmarks use it directly);
:class:`EngineHandle` is a cell's running engine whatever its backend: the processes that serve it,
the URL of node rank 0, its health and its stop. Nothing here knows which backend runs: the
backends (:mod:`gyre.engine.backends`) build the command lines and hand them to
:meth:`EngineHandle.spawn`.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Sequence

from gyre.engine.ready import READY_MARKER


class EngineStartError(RuntimeError):
    pass


class EngineProcess:
    """A running engine subprocess: ``.url``, ``.proc``, ``.stop()``; also a context manager."""

    def __init__(self, proc: subprocess.Popen, url: str, key_file: Path | None):
        self.proc, self.url = proc, url
        self._key_file = key_file
        self.output: list[str] = []  # the server's later stdout/stderr lines (for debugging)
        self._drain = threading.Thread(target=self._read, daemon=True)
        self._drain.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line.rstrip("\n"))

    def stop(self, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._key_file is not None:
            self._key_file.unlink(missing_ok=True)
        self._drain.join(timeout=2)
        return self.proc.returncode

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_engine(model_dir: str | os.PathLike | None = None, port: int = 0, api_key: str | None = None,
                 extra_args: tuple | list = (), host: str = "127.0.0.1", timeout_s: float = 120.0) -> EngineProcess:
    """Start ``python -m gyre.engine.cli`` and wait until it listens (the API key goes through a
    private file, not the command line)."""
    cmd = [sys.executable, "-m", "gyre.engine.cli", "--host", host, "--port", str(port)]
    if model_dir is not None:
        cmd += ["--model", str(model_dir)]
    key_file = None
    if api_key is not None:
        fd, name = tempfile.mkstemp(prefix="gyre-engine-key-")  # created 0600
        with os.fdopen(fd, "w") as f:
            f.write(api_key)
        key_file = Path(name)
        cmd += ["--api-key-file", name]
    cmd += [str(a) for a in extra_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    # A reader thread, so a server that hangs before printing cannot block us past the deadline.
    ready: list[str] = []
    done = threading.Event()

    def wait_ready() -> None:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith(READY_MARKER):
                ready.append(line.split()[1])
                break
        done.set()

    t = threading.Thread(target=wait_ready, daemon=True)
    t.start()
    done.wait(max(0.0, deadline - time.monotonic()))
    if not ready:
        proc.kill()
        proc.wait()
        t.join(timeout=2)
        if key_file is not None:
            key_file.unlink(missing_ok=True)
        tail = "\n".join(lines[-30:])
        raise EngineStartError(f"engine did not start (exit code {proc.returncode}): {' '.join(cmd)}\n{tail}")
    t.join()
    return EngineProcess(proc, ready[0], key_file)


HEALTH_POLL_S = 0.2


class EngineHandle:
    """A running engine of one cell: every process that serves it (one per node rank locally, or the
    srun step), the URL of node rank 0, and its life cycle. Also a context manager."""

    def __init__(self, procs: list[subprocess.Popen], url: str, backend: str, nodes: Sequence[str],
                 api_key: str | None, output: collections.deque | list | None = None, on_stop=None):
        self.procs, self.url, self.backend, self.nodes = list(procs), url, backend, list(nodes)
        self._api_key = api_key
        self.output = output if output is not None else collections.deque(maxlen=400)
        self._on_stop = on_stop
        self._stopped = False
        self.key_file: Path | None = None  # where the engine read its key from (deleted by stop)

    @classmethod
    def spawn(cls, commands: list[list[str]], url: str, backend: str, nodes: Sequence[str],
              api_key: str | None, env: dict | None = None) -> "EngineHandle":
        """Start one process per command (node rank order); their output is kept for error messages."""
        output: collections.deque = collections.deque(maxlen=400)
        procs = []
        try:
            for i, cmd in enumerate(commands):
                p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                     env=env if env is not None else dict(os.environ), start_new_session=True)
                procs.append(p)
                threading.Thread(target=_collect, args=(p, output, f"[rank {i}] " if len(commands) > 1 else ""),
                                 daemon=True).start()
        except OSError as e:
            for p in procs:
                p.kill()
            raise EngineStartError(f"cannot start {commands[len(procs)][:3]}: {e}") from e
        return cls(procs, url, backend, nodes, api_key, output)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def alive(self) -> bool:
        """True while every process runs: a node rank that died leaves the engine unusable."""
        return not self._stopped and all(p.poll() is None for p in self.procs)

    def healthy(self, timeout_s: float = 5.0) -> bool:
        """GET /health answers 200 (any body: SGLang's is empty)."""
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(self.url + "/health", headers=headers),
                                        timeout=timeout_s) as r:
                return r.status == 200
        except (OSError, urllib.error.HTTPError):
            return False

    def wait_healthy(self, timeout_s: float) -> None:
        """Block until /health answers 200; raise :class:`EngineStartError` if a process exits first
        or the time is up (the processes are left running: the caller decides whether to stop)."""
        deadline = time.monotonic() + timeout_s
        while True:
            dead = [(i, p.returncode) for i, p in enumerate(self.procs) if p.poll() is not None]
            if dead:
                raise EngineStartError(f"{self.backend} engine process(es) {dead} (node rank, exit code) exited "
                                       f"while starting\n{self.tail()}")
            if self.healthy(timeout_s=min(5.0, max(0.5, deadline - time.monotonic()))):
                return
            if time.monotonic() > deadline:
                raise EngineStartError(f"{self.backend} engine did not answer GET {self.url}/health within "
                                       f"{timeout_s:.0f} s (engine.startup_timeout_s)\n{self.tail()}")
            time.sleep(HEALTH_POLL_S)

    def tail(self, n: int = 30) -> str:
        return "\n".join(list(self.output)[-n:])

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM node rank 0 (the others follow it), then any rank still running; SIGKILL whatever
        outlives ``timeout``. Returns rank 0's exit code. Idempotent."""
        if self._on_stop is not None:
            code, self._on_stop = self._on_stop(timeout), None
            self._stopped = True
            return code
        deadline = time.monotonic() + timeout
        first, rest = self.procs[0], self.procs[1:]
        if first.poll() is None:
            first.send_signal(signal.SIGTERM)
        _wait_or_kill(first, deadline)
        for p in rest:  # the other node ranks end with rank 0; a short grace before SIGTERM
            try:
                p.wait(max(0.0, min(5.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGTERM)
            _wait_or_kill(p, deadline)
        self._stopped = True
        return self.procs[0].returncode

    def __enter__(self) -> "EngineHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _wait_or_kill(p: subprocess.Popen, deadline: float) -> None:
    try:
        p.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # its own session: its children go too
        p.wait()


def _collect(proc: subprocess.Popen, sink: collections.deque, prefix: str) -> None:
    for line in proc.stdout:
        sink.append(prefix + line.rstrip("\n"))


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on this machine right now (the engine binds it a moment later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def srun_step(commands: Sequence[Sequence[str]], nodes: Sequence[str], srun: Sequence[str]) -> list[str]:
    """ONE Slurm job step running ``commands[i]`` on ``nodes[i]`` (one task per node). Each task
    finds its command by its Slurm node name (``SLURMD_NODENAME``), so rank 0 is ``nodes[0]``
    whatever order Slurm numbers the step's nodes in. ``--kill-on-bad-exit``: a node whose
    server dies ends the step, which the agent then sees as a dead engine."""
    if len(nodes) != len(commands):
        raise ValueError(f"{len(nodes)} node names for {len(commands)} command(s)")
    cases = "".join(f"{shlex.quote(n)}) exec {shlex.join(list(map(str, c)))};; " for n, c in zip(nodes, commands))
    script = (f'case "$SLURMD_NODENAME" in {cases}*) echo "gyre: node $SLURMD_NODENAME is not one of '
              f'{shlex.quote(",".join(nodes))}" >&2; exit 2;; esac')
    n = len(nodes)
    return [*srun, f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", f"--nodelist={','.join(nodes)}",
            "--kill-on-bad-exit=1", "bash", "-c", script]
