"""Start engines.

:func:`start_cell_engine` is THE seam: it starts a cell's engine, embedded or SGLang, and is what
``gyre engine``, ``gyre rollout`` and the cell agent call (its contract is in its docstring). Below it, :func:`start_engine` runs ``python -m gyre.engine.cli`` as a
subprocess and returns once it printed its ``GYRE_ENGINE_LISTENING`` line (tests and benchmarks use
it directly).
"""

from __future__ import annotations

import collections
import contextlib
import os
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

from gyre.config import ConfigError, EngineBackend
from gyre.engine.ready import READY_MARKER
from gyre.engine.sglang_launch import SGLangSpec, srun_step
from gyre.model.families import ModelFormatError, family_of, text_config
from gyre.model.families import read_config


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


def start_cell_engine(cfg, model_dir: str | os.PathLike, *, api_key: str | None, nodes: Sequence[str] = (),
                      port: int = 0, dist_init_port: int = 0, weight_version: str = "0",
                      srun: Sequence[str] | None = None, extra_args: Sequence[str] = (),
                      wait: bool = True, env: dict | None = None) -> EngineHandle:
    """Start the engine of one cell and (``wait``) return once ``GET /health`` on node rank 0 answers.

    ``cfg.engine.backend`` picks the engine:

    * ``embedded``: one ``python -m gyre.engine.cli`` on this machine (the cell's node 0) whatever
      ``nodes`` says: the embedded engine does not span nodes. ``extra_args`` go to it.
    * ``sglang``: ``python -m <engine.sglang_launcher>`` with SGLang's flags, one server per node of
      ``nodes`` (``--nnodes/--node-rank/--dist-init-addr`` when there are several; node rank 0
      serves HTTP). ``srun`` None: every node rank is a process on this machine (tests, one-machine
      runs); else ``srun`` is the step prefix (e.g. ``["srun", "--jobid=1", "--overlap"]``) and the
      ranks run as ONE job step over ``nodes``.

    ``port`` 0 takes a free port (on this machine; under srun give a real one). ``dist_init_port``
    0 takes a free one locally, ``port + 100`` under srun. Raises :class:`EngineStartError` when
    the engine does not come up (with the tail of its output) and ``ConfigError`` for settings that
    cannot work (e.g. a tensor-parallel size the node count does not divide).
    """
    e = cfg.engine
    nodes = list(nodes) or ["localhost"]
    wildcard = e.host in ("0.0.0.0", "::", "")
    if e.backend == EngineBackend.EMBEDDED:
        settings = [a for k in ("max_running_requests", "max_new_tokens_cap", "max_body_bytes", "pace")
                    for a in ("--set", f"engine.{k}={getattr(e, k)}")]  # the caller's config, not defaults
        proc = start_engine(model_dir, port=port, api_key=api_key, host=e.host,
                            extra_args=["--weight-version", str(weight_version), *settings, *extra_args],
                            timeout_s=e.startup_timeout_s)
        url = proc.url.replace("127.0.0.1", socket.getfqdn()) if wildcard else proc.url
        handle = EngineHandle([proc.proc], url, "embedded", nodes[:1], api_key, output=proc.output,
                              on_stop=proc.stop)
        handle.key_file = proc._key_file
        if wait:
            handle.wait_healthy(e.startup_timeout_s)
        return handle
    if e.backend != EngineBackend.SGLANG:
        raise ConfigError(f"engine.backend: {e.backend!r} is not allowed; choose embedded or sglang")

    local = srun is None
    n = len(nodes)
    if local and not port:
        port = free_port()
    if not port:
        raise ConfigError("engine.port: a cell engine launched through srun needs a real port (not 0)")
    if not local and e.host in ("127.0.0.1", "localhost", "::1"):
        raise ConfigError(f"engine.host {e.host}: an engine launched on the cell's nodes must be reachable from "
                          "the head; set engine.host = \"0.0.0.0\" (the URL then names the cell's node 0)")
    dist_host = "127.0.0.1" if local else nodes[0]
    if n > 1 and not dist_init_port:
        dist_init_port = free_port() if local else port + 100
    tp = e.tp_size or max(1, cfg.sched.gpus_per_node) * n
    spec = SGLangSpec(str(model_dir), host=e.host, port=port, api_key=api_key, tp=tp, nnodes=n,
                      dist_init_addr=f"{dist_host}:{dist_init_port}" if n > 1 else "",
                      weight_version=str(weight_version), launcher=e.sglang_launcher,
                      extra=[str(a) for a in e.sglang_args] + _routing_flag(cfg, e.sglang_args),
                      hybrid=_is_hybrid(model_dir))
    try:
        commands = ([spec.command(node_rank=r) for r in range(n)] if local
                    else [srun_step(spec, nodes, list(srun))])
    except ValueError as err:
        raise ConfigError(str(err)) from None
    url_host = ("127.0.0.1" if local else nodes[0]) if wildcard else e.host
    handle = EngineHandle.spawn(commands, f"http://{url_host}:{port}", "sglang", nodes, api_key, env=env)
    if wait:
        try:
            handle.wait_healthy(e.startup_timeout_s)
        except EngineStartError as err:
            handle.stop(timeout=5)
            if f"No module named '{e.sglang_launcher.split('.')[0]}'" in str(err):
                raise EngineStartError(f"{err}\n(engine.sglang_launcher = {e.sglang_launcher!r} is not installed for "
                                       f"{sys.executable}: install SGLang on the GPU nodes, or set it to "
                                       "gyre.engine.sglang_standin to test without GPUs)") from None
            raise
        except BaseException:
            handle.stop(timeout=5)
            raise
    return handle


def serve_cell_engine(cfg, model_dir: str | os.PathLike, *, api_key: str | None, port: int,
                      weight_version: str = "0") -> int:
    """``gyre engine`` for a backend other than the in-process embedded one: start it through the
    seam, print the ready marker, and run until SIGINT/SIGTERM or until the engine exits."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            handle = start_cell_engine(cfg, model_dir, api_key=api_key, port=port, weight_version=weight_version)
        except EngineStartError as e:
            print(f"gyre engine: {e}", file=sys.stderr)
            return 1
        with handle:
            print(f"{READY_MARKER} {handle.url}", flush=True)
            while not stop.wait(0.5):
                if not handle.alive():
                    print(f"gyre engine: the {handle.backend} engine exited\n{handle.tail()}", file=sys.stderr)
                    return 1
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _routing_flag(cfg, args) -> list[str]:
    """train.routing_replay: SGLang returns routed experts only when started with this flag."""
    flag = "--enable-return-routed-experts"
    return [flag] if cfg.train.routing_replay and flag not in map(str, args) else []


def _is_hybrid(model_dir) -> bool:
    """Whether the model directory holds a hybrid (Gated DeltaNet) family; False when it cannot be
    read here (SGLang then reports the directory itself)."""
    try:
        return family_of(text_config(read_config(model_dir))).hybrid
    except ModelFormatError:
        return False
