"""Start a cell's engine through the backend table.

:func:`start_cell_engine` is THE seam: it starts a cell's engine with the backend
``engine.backend`` names (:mod:`gyre.engine.backends`: one module per backend) and is what
``gyre engine``, ``gyre rollout`` and the cell agent call (its contract is in its docstring).
This module names no backend: what differs between them lives in their modules. The process
machinery (:func:`start_engine`, :class:`EngineHandle`) is :mod:`gyre.engine.process`,
re-exported here for the callers that start the embedded engine directly.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Sequence

from gyre.engine import backends
from gyre.engine.process import EngineHandle, EngineProcess, EngineStartError, free_port, start_engine
from gyre.engine.ready import READY_MARKER

__all__ = ["EngineHandle", "EngineProcess", "EngineStartError", "free_port", "start_engine",
           "start_cell_engine", "serve_cell_engine"]


def start_cell_engine(cfg, model_dir: str | os.PathLike, *, api_key: str | None, nodes: Sequence[str] = (),
                      port: int = 0, dist_init_port: int = 0, weight_version: str = "0",
                      srun: Sequence[str] | None = None, extra_args: Sequence[str] = (),
                      wait: bool = True, env: dict | None = None) -> EngineHandle:
    """Start the engine of one cell and (``wait``) return once ``GET /health`` on node rank 0 answers.

    ``cfg.engine.backend`` picks the backend module (see :mod:`gyre.engine.backends` and each
    module's docstring for what it starts): the embedded engine runs one process on this machine
    whatever ``nodes`` says; SGLang and vLLM run one server per node of ``nodes`` where they span
    nodes. ``srun`` None: every node rank is a process on this machine (tests, one-machine runs);
    else ``srun`` is the step prefix (e.g. ``["srun", "--jobid=1", "--overlap"]``) and the ranks
    run as ONE job step over ``nodes``.

    ``port`` 0 takes a free port (on this machine; under srun give a real one). ``dist_init_port``
    0 takes a free one locally, ``port + 100`` under srun. Raises :class:`EngineStartError` when
    the engine does not come up (with the tail of its output) and ``ConfigError`` for settings that
    cannot work (e.g. a tensor-parallel size the node count does not divide).
    """
    backend = backends.get(cfg.engine.backend)
    backend.check(cfg, model_dir)
    handle = backend.launch(cfg, model_dir, api_key=api_key, nodes=list(nodes) or ["localhost"], port=port,
                            dist_init_port=dist_init_port, weight_version=str(weight_version), srun=srun,
                            extra_args=[str(a) for a in extra_args], env=env)
    if wait:
        try:
            handle.wait_healthy(cfg.engine.startup_timeout_s)
            backend.ready(cfg, handle, api_key, str(weight_version))
        except EngineStartError as err:
            handle.stop(timeout=5)
            better = backend.start_failed(cfg, str(err))
            if better:
                raise EngineStartError(better) from None
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
