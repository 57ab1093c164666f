"""A cell's trainer as seen by its agent: ``ranks`` processes of gyre.cell.trainer_rank over the cell's nodes.

Launch: local processes (``gyre run``, tests) or ONE ``srun`` job step over the cell's nodes
(``srun=[...]`` prefix given by the agent under Slurm). Rank 0 connects back to a listener here
(authenticated with a key only the job's processes hold) and answers for the cell; every request
is carried out by every rank. A trainer with any dead rank is dead as a whole: the first call
that notices raises :class:`TrainerDied`, the agent kills what is left and starts a new
incarnation (``gen`` + 1), which forms new groups from the job's store.

The processes are fresh interpreters (``python -m gyre.cell.trainer_rank``), not multiprocessing
children: a spawned child re-imports the parent's ``__main__``, which under MPI could initialise
MPI a second time in a process the launcher does not know.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Listener
from typing import Any, Callable

from gyre.config import TrainConfig
from gyre.cell.trainer_messages import (Applied, Apply, Close, ExportWeights, ForwardBackward, Hostnames, LoadCheckpoint,
                                 Logprobs, Offload, ReduceGrads, GradsReduced, Reply, Request, Restore, SaveCheckpoint, Start, Started,
                                 Stash, Stashed)
from gyre.position import Position

DEFAULT_TIMEOUT_S = 600.0


class TrainerError(RuntimeError):
    """The trainer raised; its processes are alive and usable."""


class TrainerDied(RuntimeError):
    """A trainer process is gone, or the trainer did not answer in time (and was killed)."""


class TrainerProcess:
    """Parent side. Construction starts the ranks and returns at once; the first call (or
    :meth:`wait_ready`) waits until every rank has loaded the model.

    ``store``: (host, port) of the job's TCPStore; None = serve a private one (a lone cell).
    ``advertise``: the host name rank 0 dials back (this node's name under Slurm).
    ``srun``: None = local processes; else the argv prefix of one job step over ``nodes`` with
    ``ranks`` tasks (e.g. ``["srun", "--overlap", "--jobid", ID]``).
    Every call accepts ``on_wait``: called about every ``tick_s`` while waiting.
    """

    def __init__(self, cfg: TrainConfig, model_dir: str | os.PathLike, seed: int = 0, *,
                 offloaded: bool = False, checkpoint: str | os.PathLike | None = None,
                 init_state: str | os.PathLike | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, tick_s: float = 0.5, cell: int = 0, gen: int = 0,
                 ranks: int = 1, store: tuple[str, int] | None = None, advertise: str = "127.0.0.1",
                 srun: list[str] | None = None, nodes: list[str] | tuple = ()) -> None:
        self.timeout_s, self.tick_s, self.cell, self.gen, self.ranks = timeout_s, tick_s, cell, gen, ranks
        self._own_store = None
        self._srun = srun is not None
        if store is None:
            from gyre.cell.groups import serve_store  # torch.distributed: only for a multi-rank trainer

            self._own_store = serve_store()
            store = ("127.0.0.1", self._own_store.port)
        self.store_addr = store
        authkey = secrets.token_bytes(32)
        self._listener = Listener(("0.0.0.0" if advertise != "127.0.0.1" else "127.0.0.1", 0), authkey=authkey)
        port = self._listener.address[1]
        self._accepted: list = []
        threading.Thread(target=self._accept, daemon=True, name=f"trainer-accept-{cell}").start()
        base = [sys.executable, "-m", "gyre.cell.trainer_rank", "--cell", str(cell), "--gen", str(gen),
                "--store", f"{store[0]}:{store[1]}", "--agent", f"{advertise}:{port}",
                "--timeout-s", str(timeout_s)]
        env = {**os.environ, "GYRE_TRAINER_AUTHKEY": authkey.hex()}
        if srun is None:
            self.procs = [subprocess.Popen(base + ["--rank", str(r), "--size", str(ranks)], env=env,
                                           stdin=subprocess.DEVNULL) for r in range(ranks)]
        else:
            if not nodes or ranks % len(nodes):
                raise ValueError(f"{ranks} trainer ranks cannot be spread evenly over nodes {list(nodes)}")
            step = [*srun, f"--nodes={len(nodes)}", f"--ntasks={ranks}", f"--ntasks-per-node={ranks // len(nodes)}",
                    f"--nodelist={','.join(nodes)}", "--kill-on-bad-exit=1", "--cpu-bind=none"]
            self.procs = [subprocess.Popen(step + base, env=env, stdin=subprocess.DEVNULL, start_new_session=True)]
        self._init = Start(cfg=dataclasses.asdict(cfg), model_dir=str(model_dir), seed=seed, offloaded=offloaded,
                           checkpoint=str(checkpoint) if checkpoint else None,
                           init_state=str(init_state) if init_state else None)
        self._conn = None
        self.step: int | None = None  # the trainer's optimizer step = its policy version
        self.update = 0               # updates applied inside its open step (train.minibatches_per_step)
        self.num_grad_elements = 0
        self._ready = False

    def _accept(self) -> None:
        try:
            self._accepted.append(self._listener.accept())
        except Exception as e:  # noqa: BLE001 - a bad handshake or a closed listener: rank 0 never came
            self._accepted.append(e)

    @property
    def position(self) -> Position:
        """Where the trainer stands (its step and the updates applied inside the next)."""
        if self.step is None:
            raise RuntimeError("the trainer has not said where it stands yet: wait_ready first")
        return Position(self.step, self.update)

    @property
    def pid(self) -> int:
        return self.procs[0].pid

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def wait_ready(self, timeout_s: float | None = None, on_wait: Callable[[], Any] | None = None) -> None:
        if self._ready:
            return
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while not self._accepted:
            if not self.alive():
                raise self._died("start")
            if time.monotonic() > deadline:
                self.kill()
                raise TrainerDied(f"trainer rank 0 of cell {self.cell} did not connect within "
                                  f"{timeout_s or self.timeout_s:.0f} s; killed it")
            if on_wait is not None:
                on_wait()
            time.sleep(0.01)
        got = self._accepted[0]
        if isinstance(got, Exception):
            self.kill()
            raise TrainerDied(f"trainer rank 0 of cell {self.cell} could not connect: {got}")
        self._conn = got
        self._conn.send(self._init)
        info: Started = self._receive(self._init, deadline - time.monotonic(), on_wait)
        self.num_grad_elements = info.num_grad_elements
        self._ready = True

    # --- the cell trainer's requests ------------------------------------------------------------
    def forward_backward(self, wire_mb: dict, step: int = 0, update: int = 0, **kw) -> dict:
        """One micro-batch (:func:`gyre.batch.to_wire` form), rows split over the ranks; its stats."""
        return self.request(ForwardBackward(wire_mb, step, update), **kw)

    def logprobs(self, wire_mb: dict, **kw):
        """pi_prox of one micro-batch: its targets' current log-probs (numpy float32, target order)."""
        return self.request(Logprobs(wire_mb), **kw)

    def stash(self, step: int, update: int = 0, **kw) -> Stashed:
        """Sum this step's gradients over the cell's ranks into the ranks' held vector."""
        return self.request(Stash(step, update), **kw)

    def reduce(self, step: int, members: list[int], attempt: int, update: int = 0, **kw) -> GradsReduced:
        """Sum the held gradients over the member cells (cross-cell groups)."""
        return self.request(ReduceGrads(step, tuple(sorted(members)), attempt, update), **kw)

    def apply(self, step: int, update: int = 0, final: bool = True, **kw) -> Applied:
        """The optimizer update with the last reduce's sum (``step`` after it, ``grad_norm``);
        ``final`` False: an update inside the step (the step is not counted)."""
        return self.request(Apply(step, update, final), **kw)

    def offload(self, **kw) -> dict:
        return self.request(Offload(), **kw)

    def restore(self, **kw) -> dict:
        return self.request(Restore(), **kw)

    def save_checkpoint(self, path: str | os.PathLike, **kw) -> str:
        return self.request(SaveCheckpoint(str(path)), **kw)

    def load_checkpoint(self, path: str | os.PathLike, **kw) -> None:
        return self.request(LoadCheckpoint(str(path)), **kw)

    def export_weights(self, out_dir: str | os.PathLike, version: int | str, **kw) -> str:
        return self.request(ExportWeights(str(out_dir), version), **kw)

    def hostnames(self, **kw) -> list[str]:
        return self.request(Hostnames(), **kw)

    # --- lifecycle ------------------------------------------------------------------------------
    def kill(self) -> None:
        if self._srun and self.procs[0].poll() is None:
            # srun forwards SIGTERM to every task of the step and ends it; SIGKILL would leave
            # the remote ranks to Slurm's own clean-up
            self.procs[0].terminate()
            try:
                self.procs[0].wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._close_channels()

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the ranks to exit; kill them if they do not within ``timeout_s``."""
        if self._conn is not None and not self._conn.closed and self.alive():
            try:
                self._conn.send(Close())
                for p in self.procs:
                    p.wait(timeout=timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def _close_channels(self) -> None:
        if self._conn is not None and not self._conn.closed:
            self._conn.close()
        try:
            self._listener.close()
        except OSError:
            pass

    # --- transport ------------------------------------------------------------------------------
    def request(self, msg: Request, *, timeout_s: float | None = None,
                on_wait: Callable[[], Any] | None = None) -> Any:
        """Send one request to the ranks and return its reply's value (see gyre.cell.trainer_messages)."""
        if not isinstance(msg, Request) or isinstance(msg, (Start, Close)):
            raise TypeError(f"not a trainer request: {msg!r}")
        timeout_s = timeout_s or self.timeout_s
        self.wait_ready(timeout_s, on_wait)
        try:
            self._conn.send(msg)
        except OSError:
            raise self._died(msg.name) from None
        return self._receive(msg, timeout_s, on_wait)

    def _receive(self, msg: Request, timeout_s: float, on_wait) -> Any:
        method = msg.name
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                # its state (and our pipe) is now unknown: a stale answer must not be taken
                # for the next request's, so the ranks go
                self.kill()
                raise TrainerDied(f"trainer of cell {self.cell} did not answer {method} within "
                                  f"{timeout_s:.0f} s; killed it")
            try:
                if self._conn.poll(min(left, self.tick_s)):
                    reply: Reply = self._conn.recv()
                    break
            except (EOFError, OSError):
                raise self._died(method) from None
            if not self.alive():  # a rank other than 0 died: rank 0 may wait in a collective forever
                raise self._died(method)
            if on_wait is not None:
                on_wait()
        self.step, self.update = reply.step, reply.update or 0
        if not reply.ok:
            if isinstance(msg, Start):
                self.kill()
                raise TrainerDied(f"trainer of cell {self.cell} failed to start: {reply.error}")
            raise TrainerError(f"trainer {method} failed: {reply.error}")
        return reply.value

    def _died(self, method: str) -> TrainerDied:
        dead = [(i, p.poll()) for i, p in enumerate(self.procs) if p.poll() is not None]
        self.kill()
        if not dead:
            return TrainerDied(f"trainer of cell {self.cell} lost its connection during {method}")
        i, rc = dead[0]
        how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
        what = f"rank {i}" if len(self.procs) > 1 else "the srun step" if self.ranks > 1 else f"process {self.procs[i].pid}"
        return TrainerDied(f"trainer of cell {self.cell}: {what} died ({how}) during {method}")
