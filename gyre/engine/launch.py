"""Start an embedded engine for tests, demos and benchmarks.

:func:`start_engine` runs ``python -m gyre.engine.cli`` as a subprocess and returns once it
printed its ``GYRE_ENGINE_LISTENING`` line; :class:`InProcessEngine` runs the same server on a
background thread of this process (no process start-up; used by benchmarks).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from gyre.engine.server import READY_MARKER


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


class InProcessEngine:
    """An :class:`~gyre.engine.runtime.Engine` and its HTTP server on a background thread."""

    def __init__(self, model_dir: str | os.PathLike, api_key: str | None = None, host: str = "127.0.0.1",
                 port: int = 0, **engine_kwargs):
        from gyre.engine.runtime import Engine
        from gyre.engine.server import EngineServer

        self.engine = Engine(model_dir, **engine_kwargs)
        self._loop = asyncio.new_event_loop()
        self._server = EngineServer(self.engine, host, port, api_key)
        self._thread = threading.Thread(target=self._loop.run_forever, name="gyre-engine-http", daemon=True)
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._server.start(), self._loop).result(30)

    def stop(self) -> None:
        if not self._loop.is_closed():
            asyncio.run_coroutine_threadsafe(self._server.close(), self._loop).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()
            self.engine.close()

    def __enter__(self) -> "InProcessEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
