"""The cell's engine: its processes behind the one engine seam (gyre.engine.launch), what it
serves, and the admin calls a role switch and a weight push make, each a typed method.

Which engine runs is the backend table's business (gyre.engine.backends): this module asks it for
the admin of the running engine (release/resume memory or their absence, weight load from a
directory with a version, abort) and never names a backend. Restarts load what the last engine
served.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

from gyre.cell.command import CommandError, timed
from gyre.cell.placement import Placement
from gyre.config import GyreConfig
from gyre.engine import backends
from gyre.engine.backends import EngineAdmin, EngineAdminError
from gyre.engine.launch import EngineHandle, start_cell_engine
from gyre.engine.reaper import ProcessList

ENGINE_CALL_S = 120.0    # bound on one engine admin call (weight loads included)


class CellEngine:
    """One cell's engine (none running until :meth:`start`); ``version`` and ``weights`` say what
    it serves, and survive a restart."""

    def __init__(self, cfg: GyreConfig, model_dir: str | os.PathLike, *, api_key: str, cell: int,
                 placement: Placement, pids: ProcessList, extra_args: list[str]) -> None:
        self.cfg, self.model_dir, self.api_key, self.cell = cfg, Path(model_dir), api_key, cell
        self.placement, self.pids, self.extra_args = placement, pids, list(extra_args)
        self.handle: EngineHandle | None = None
        self.admin: EngineAdmin | None = None
        self.backend = backends.get(cfg.engine.backend)
        self.weights = str(self.model_dir)  # what the engine serves (restarts load it)
        self.version = "0"

    @property
    def url(self) -> str | None:
        return self.handle.url if self.handle else None

    @property
    def pid(self) -> int | None:
        return self.handle.procs[0].pid if self.handle else None

    def alive(self) -> bool:
        return self.handle is not None and self.handle.alive()

    def exit_code(self) -> int | None:
        return self.handle.procs[0].poll() if self.handle else None

    def start(self) -> None:
        """Start an engine serving what the last one served. It boots from the model directory
        (exported weights carry no tokenizer), then loads the current weights if they differ."""
        srun, port = None, 0
        if self.placement.in_slurm_step and self.backend.capabilities.spans_nodes:
            srun, port = list(self.placement.srun), self.cfg.engine.port + self.cell
        self.handle = start_cell_engine(self.cfg, self.model_dir, api_key=self.api_key,
                                        nodes=self.placement.nodes, port=port, srun=srun,
                                        extra_args=["--weight-version", "0", *self.extra_args])
        self.pids.add("engine", self.handle.pids, self.handle.key_file)
        self.admin = self.backend.admin(self.cfg, self.handle.url, self.api_key, ENGINE_CALL_S)
        if self.version != "0":
            self.admin.load_weights(self.weights, self.version)

    def stop(self, timeout: float = 10.0) -> None:
        """End the engine's processes (idempotent)."""
        handle, self.handle, self.admin = self.handle, None, None
        if handle is not None:
            handle.stop(timeout=timeout)

    def release(self) -> None:
        self.admin.release_memory()

    def resume(self) -> None:
        self.admin.resume_memory()

    def drain_and_release(self, timeout_s: float, phases: dict, on_wait: Callable[[], None]) -> int:
        """Release the engine's memory; returns how many refusals it took. The head took the cell
        out of the router and aborted the router's requests there first (it knows the in-flight
        count; the engine's /health tells nothing); whatever still runs is aborted here, and a
        release the engine refuses while requests finish is retried within ``timeout_s``."""
        self.admin.abort_all()
        deadline = time.monotonic() + timeout_s
        tries = 0
        while True:
            tries += 1
            try:
                with timed(phases, "release"):
                    self.release()
                return tries - 1
            except EngineAdminError as e:
                if time.monotonic() > deadline:
                    raise CommandError(f"the engine refused to release its memory for {timeout_s:.0f} s: {e}") from e
                self.admin.abort_all()  # aborted requests end at their next step
                on_wait()
                time.sleep(0.01)

    def load(self, version, weights) -> None:
        """Serve ``version`` from ``weights`` (a directory), unless it is served already."""
        if version is None or str(version) == self.version:
            return
        if not weights:
            raise CommandError(f"the engine serves version {self.version}; version {version} "
                               "needs its weights directory")
        self.admin.load_weights(str(weights), str(version))
        self.weights, self.version = str(weights), str(version)
