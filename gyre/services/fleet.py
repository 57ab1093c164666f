"""The cell fleet: the book of cells and the typed commands to their agents.

The only code that builds a `Command` or reads a `Reply` or an agent's `Event` (gyre.sched.protocol):
a change of the protocol's types lands here. Commands to one cell never overlap (one lock per
cell); each has a timeout after which it counts as failed. Every role change is told to the run's
event stream (`CellRoleChanged`), so the report's per-cell time comes from one place.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from gyre.events import CellRoleChanged
from gyre.fsio import atomic_write_json
from gyre.position import Position
from gyre.sched.cells import Cell
from gyre.sched.protocol import (Command, Event, EventKind, PrepareReduce, PushWeights, Reduce, Reply, Stop,
                                 ToRollout, ToTrain, Train, reply_for)
from gyre.sched.state import Role


class StartError(RuntimeError):
    """A process of the job could not start (a cell's engine or trainer): the job ends at once,
    with this one line."""


@dataclass(frozen=True)
class WeightPaths:
    """Where version v's weights (what engines load) and checkpoint (what trainers load) live."""
    model_dir: Path      # version 0: the model itself
    weights_root: Path
    ckpt_root: Path

    def weights(self, version: int) -> str:
        return str(self.model_dir) if version == 0 else str(self.weights_root / str(Position(version)))

    def checkpoint(self, version: int, update: int = 0) -> str:
        """``update`` > 0: the trainer inside step ``version`` after that many of its updates
        (train.minibatches_per_step), what a trainer that dies or joins mid-step loads."""
        at = Position(version, update)
        return "" if at == Position(0) else str(self.ckpt_root / str(at))


class CellFleet:
    def __init__(self, link, n_cells: int, *, emit: Callable, clock: Callable[[], float],
                 on_engine_restarted: Callable[[Cell, str], None] | None = None):
        self.link, self.emit, self.clock = link, emit, clock
        self.cells = [Cell(i, i + 1) for i in range(n_cells)]
        self.paths: WeightPaths | None = None            # set at start-up, once the model is known
        self.on_engine_restarted = on_engine_restarted
        self.info: dict[int, dict] = {}                  # what each agent last said about itself
        self.events: list[dict] = []                     # restarts and failures, for the report
        self.errors: list[str] = []
        self.t0 = clock()
        self._futures: dict[int, asyncio.Future] = {}
        self._locks = [asyncio.Lock() for _ in range(n_cells)]
        self._hello = asyncio.Event()
        self.start_error = ""  # a cell's reason for not starting (Event fatal, what = start)

    def __iter__(self):
        return iter(self.cells)

    def __getitem__(self, i: int) -> Cell:
        return self.cells[i]

    def __len__(self) -> int:
        return len(self.cells)

    def in_role(self, role: Role) -> list[Cell]:
        return [c for c in self.cells if c.role is role]

    def busy(self, cell: Cell) -> bool:
        """A command to this cell is in flight."""
        return self._locks[cell.id].locked()

    def set_role(self, cell: Cell, role: Role, now: float) -> None:
        if role is not cell.role:
            self.emit(CellRoleChanged(now, cell.id, role.value))
        cell.set_role(role, now)

    def fail(self, cell: Cell, why: str, now: float | None = None) -> None:
        self.errors.append(why)
        self.set_role(cell, Role.FAILED, self.clock() if now is None else now)

    # ---- messages from the agents --------------------------------------------------------------
    def on_message(self, msg) -> None:
        """Called in the event loop for every message a cell sends."""
        now = self.clock()
        if isinstance(msg, Reply):
            self.cells[msg.cell].last_seen = now
            fut = self._futures.pop(msg.seq, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, Event):
            cell = self.cells[msg.cell]
            cell.last_seen = now
            self.info[cell.id] = {**self.info.get(cell.id, {}), **msg.info}
            if msg.kind not in (EventKind.HEARTBEAT, EventKind.HELLO):
                self.events.append({"t": now - self.t0, "cell": cell.id, "kind": msg.kind.value, "info": msg.info})
            if msg.kind is EventKind.HELLO:
                cell.engine_url, cell.hostname = msg.info["engine_url"], msg.info.get("hostname", "")
                cell.since = now
                if all(c.engine_url for c in self.cells):
                    self._hello.set()
            elif msg.kind is EventKind.ENGINE_RESTARTED:
                old, cell.engine_url = cell.engine_url, msg.info["engine_url"]
                cell.old_urls.append(old)
                if self.on_engine_restarted is not None:
                    self.on_engine_restarted(cell, old)
            elif msg.kind is EventKind.FATAL:
                self.fail(cell, f"cell {cell.id}: {msg.info}", now)
                if msg.info.get("what") == "start" and not self._hello.is_set():
                    self.start_error = f"cell {cell.id} cannot start: {msg.info.get('error', '')}"
                    self._hello.set()  # no hello will come from it: the job ends now, saying why

    async def wait_hello(self, timeout_s: float, stop: asyncio.Event | None = None,
                         why_stopped: Callable[[], str] = lambda: "stopped") -> None:
        """Until every cell said hello; StartError at once when ``stop`` is set first (a SIGTERM
        from scancel or Slurm's kill of a failed step, a Ctrl-C): the job must not sit out the
        whole start-up wait, under Slurm until its KillWait's SIGKILL."""
        hello = asyncio.ensure_future(self._hello.wait())
        stopped = asyncio.ensure_future(stop.wait()) if stop is not None else None
        try:
            await asyncio.wait([t for t in (hello, stopped) if t is not None], timeout=timeout_s,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (hello, stopped):
                if t is not None:
                    t.cancel()
        if self.start_error:
            raise StartError(self.start_error)
        if not self._hello.is_set():
            if stop is not None and stop.is_set():
                raise StartError(f"{why_stopped()} while waiting for the cells to start: nothing ran")
            raise RuntimeError(f"cells did not say hello within {timeout_s:.0f} s: " +
                               ", ".join(f"cell {c.id}" for c in self.cells if not c.engine_url))

    def check_heartbeats(self, now: float, limit_s: float) -> list[Cell]:
        """Cells silent past ``limit_s`` are marked failed; returns them."""
        gone = []
        for c in self.cells:
            if c.role is not Role.FAILED and now - c.last_seen > limit_s:
                self.fail(c, f"cell {c.id} silent for {now - c.last_seen:.0f} s: marked failed", now)
                gone.append(c)
        return gone

    # ---- commands ------------------------------------------------------------------------------
    async def call(self, cell: Cell, cmd: Command, timeout: float = 600.0) -> Reply:
        """Send one command and wait for its reply; commands to one cell never overlap."""
        async with self._locks[cell.id]:
            fut = asyncio.get_running_loop().create_future()
            self._futures[cmd.seq] = fut
            self.link.send_command(cell.id, cmd)
            try:
                return await asyncio.wait_for(fut, timeout)
            except asyncio.TimeoutError:
                self._futures.pop(cmd.seq, None)
                return reply_for(cmd, cell.id, ok=False, error=f"no reply within {timeout} s")

    def to_train(self, cell: Cell, version: int, update: int = 0):
        return self.call(cell, ToTrain(version=version, update=update,
                                       checkpoint=self.paths.checkpoint(version, update) or None))

    def to_rollout(self, cell: Cell, version: int):
        return self.call(cell, ToRollout(version=version, weights=self.paths.weights(version)))

    def push(self, cell: Cell, version: int):
        return self.call(cell, PushWeights(version=version, weights=self.paths.weights(version)))

    def train(self, cell: Cell, step: int, mid: int, batch: dict, update: int = 0, prox: bool = False):
        return self.call(cell, Train(step=step, mb_id=mid, batch=batch, update=update, prox=prox))

    def prepare_reduce(self, cell: Cell, step: int, update: int = 0):
        return self.call(cell, PrepareReduce(step=step, update=update))

    def reduce(self, cell: Cell, step: int, participants: list[Cell], leader: Cell, update: int = 0,
               final: bool = True):
        """The reduce of update ``update`` of step ``step``; the final one makes version step + 1."""
        after = Position(step, update).after(final)
        ckpt = self.paths.checkpoint(after.step, after.update)
        return self.call(cell, Reduce(
            step=step, update=update, final=final, participants=[c.id for c in participants], leader=leader.id,
            weights_dir=self.paths.weights(step + 1), checkpoint_dir=ckpt))

    def stop(self, cell: Cell):
        return self.call(cell, Stop(), timeout=60)

    # ---- what each cell is doing, for operators ------------------------------------------------
    def write_status(self, path: Path, now: float, t0: float, version: int, queued: int) -> None:
        """cells.json: what each cell is doing now (for `gyre status`, operators, fault tests)."""
        rows = [{"cell": c.id, "role": c.role.value, "since": c.since - t0, "engine_url": c.engine_url,
                 "mb_in_flight": c.mb_in_flight, **{k: self.info.get(c.id, {}).get(k)
                                                    for k in ("hostname", "engine_pid", "trainer_pid")}}
                for c in self.cells]
        atomic_write_json(path, {"version": version, "step_mbs_left": queued, "cells": rows})

    @staticmethod
    def urls_of(cell: Cell) -> set[str]:
        return {cell.engine_url, *cell.old_urls}
