"""The trainer as a child process that a cell agent supervises.

A trainer that dies (kill -9, out of memory) costs the cell the micro-batches of its current step,
never the agent: each Trainer call is one request/response over a socket pair, with a timeout,
and a dead child shows up as :class:`TrainerDied` on the next call or in :meth:`alive`.

The child is a fresh interpreter (``python -m gyre.train.worker --fd N``), not a multiprocessing
child: a spawned child re-imports the parent's ``__main__``, which under MPI could initialise MPI
a second time in a process the launcher does not know. Tensors cross as numpy arrays (by value).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, Callable

import numpy as np

from gyre.config import TrainConfig

DEFAULT_TIMEOUT_S = 600.0


class TrainerError(RuntimeError):
    """The trainer raised; the process is alive and usable."""


class TrainerDied(RuntimeError):
    """The trainer process is gone, or did not answer in time (and was killed)."""


class TrainerProcess:
    """Parent side. Construction starts the child and returns at once; the first call (or
    :meth:`wait_ready`) waits until the model is loaded.

    ``offloaded=True`` starts the trainer offloaded (cells start in rollout); ``checkpoint`` is
    loaded before that when given. Every call accepts ``on_wait``: called about every
    ``tick_s`` while waiting (a cell agent sends heartbeats from it).
    """

    def __init__(self, cfg: TrainConfig, model_dir: str | os.PathLike, seed: int = 0, *,
                 offloaded: bool = False, checkpoint: str | os.PathLike | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, tick_s: float = 0.5) -> None:
        self.timeout_s, self.tick_s = timeout_s, tick_s
        parent, child = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gyre.train.worker", "--fd", str(child.fileno())],
                pass_fds=[child.fileno()], stdin=subprocess.DEVNULL)
        finally:
            child.close()
        self._conn = Connection(parent.detach())
        self._conn.send({"cfg": dataclasses.asdict(cfg), "model_dir": str(model_dir), "seed": seed,
                         "offloaded": offloaded,
                         "checkpoint": str(checkpoint) if checkpoint else None})
        self.step: int | None = None  # the trainer's optimizer step = its policy version
        self.num_grad_elements = 0
        self._ready = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout_s: float | None = None, on_wait: Callable[[], Any] | None = None) -> None:
        if self._ready:
            return
        info = self._receive("start", timeout_s or self.timeout_s, on_wait)
        self.num_grad_elements = info["num_grad_elements"]
        self._ready = True

    # --- the Trainer API ----------------------------------------------------------------------
    def forward_backward(self, wire_mb: dict, **kw) -> dict:
        """One micro-batch (:func:`gyre.batch.to_wire` form); returns its loss stats."""
        return self._call("forward_backward", wire_mb, **kw)

    def grads(self, clear: bool = False, **kw) -> np.ndarray:
        """Flat float32 gradients accumulated since the last step (zeros if none); ``clear``
        drops them from the trainer (so it is between steps and can offload)."""
        return self._call("grads", clear, **kw)

    def apply(self, grad_sum: np.ndarray, **kw) -> dict:
        """Set the gradients to ``grad_sum`` and take the optimizer step; returns step stats
        (``grad_norm``, ``step`` = the new policy version)."""
        return self._call("apply", np.ascontiguousarray(grad_sum, dtype=np.float32), **kw)

    def offload(self, **kw) -> dict:
        return self._call("offload", **kw)

    def restore(self, **kw) -> dict:
        return self._call("restore", **kw)

    def save_checkpoint(self, path: str | os.PathLike, **kw) -> str:
        return self._call("save_checkpoint", str(path), **kw)

    def load_checkpoint(self, path: str | os.PathLike, **kw) -> None:
        return self._call("load_checkpoint", str(path), **kw)

    def export_weights(self, out_dir: str | os.PathLike, version: int | str, **kw) -> str:
        return self._call("export_weights", str(out_dir), version, **kw)

    # --- lifecycle ----------------------------------------------------------------------------
    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait(timeout=10)
        self._conn.close()

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the child to exit; kill it if it does not within ``timeout_s``."""
        if self.alive() and not self._conn.closed:
            try:
                self._conn.send(("close", ()))
                self.proc.wait(timeout=timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.alive():
            self.proc.kill()
        self.proc.wait(timeout=10)
        if not self._conn.closed:
            self._conn.close()

    # --- transport ----------------------------------------------------------------------------
    def _call(self, method: str, *args, timeout_s: float | None = None,
              on_wait: Callable[[], Any] | None = None) -> Any:
        timeout_s = timeout_s or self.timeout_s
        self.wait_ready(timeout_s, on_wait)
        try:
            self._conn.send((method, args))
        except OSError:
            raise self._died(method) from None
        return self._receive(method, timeout_s, on_wait)

    def _receive(self, method: str, timeout_s: float, on_wait) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                # its state (and our pipe) is now unknown: a stale answer must not be taken
                # for the next request's, so the child goes
                self.kill()
                raise TrainerDied(f"trainer process {self.pid} did not answer {method} within "
                                  f"{timeout_s:.0f} s; killed it")
            try:
                if self._conn.poll(min(left, self.tick_s)):
                    status, value, step = self._conn.recv()
                    break
            except (EOFError, OSError):
                raise self._died(method) from None
            if on_wait is not None:
                on_wait()
        self.step = step
        if status == "err":
            if method == "start":
                self.proc.wait(timeout=30)
                raise TrainerDied(f"trainer process {self.pid} failed to start: {value}")
            raise TrainerError(f"trainer {method} failed: {value}")
        return value

    def _died(self, method: str) -> TrainerDied:
        try:
            rc = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pipe broken but process still there: finish it
            self.proc.kill()
            rc = self.proc.wait(timeout=10)
        how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
        return TrainerDied(f"trainer process {self.pid} died ({how}) during {method}")


# --- child side ----------------------------------------------------------------------------------

def _handlers(trainer) -> dict[str, Callable]:
    import torch

    from gyre.batch import from_wire

    def grads(clear: bool) -> np.ndarray:
        g = trainer.flat_grads().numpy().astype(np.float32, copy=True)
        if clear:
            trainer.clear_gradients()
        return g

    def load_checkpoint(path: str) -> None:
        trainer.load_checkpoint(path)
        trainer.own_storage()

    def apply(vec: np.ndarray) -> dict:
        trainer.set_flat_grads(torch.from_numpy(vec))
        return trainer.apply_gradients()

    return {
        "forward_backward": lambda wire: trainer.forward_backward(from_wire(wire)),
        "grads": grads,
        "apply": apply,
        "offload": trainer.offload,
        "restore": trainer.restore,
        "save_checkpoint": lambda path: str(trainer.save_checkpoint(path)),
        "load_checkpoint": load_checkpoint,
        "export_weights": lambda out, version: str(trainer.export_weights(out, version)),
    }


def serve(conn: Connection) -> int:
    init = conn.recv()
    try:
        import torch

        from gyre.train.backends import make_trainer

        torch.set_num_threads(1)  # cells share cores with their engine and with each other
        trainer = make_trainer(TrainConfig(**init["cfg"]), init["model_dir"], seed=init["seed"])
        if init["checkpoint"]:
            trainer.load_checkpoint(init["checkpoint"])
        trainer.own_storage()  # so that offload can release what was loaded
        if init["offloaded"]:
            trainer.offload()
    except Exception as e:
        conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}", None))
        return 1
    conn.send(("ok", {"num_grad_elements": trainer.num_grad_elements()}, trainer.step))
    handlers = _handlers(trainer)
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):
            return 0  # the agent is gone: nothing left to serve
        if method == "close":
            return 0
        try:
            if method not in handlers:
                raise ValueError(f"unknown trainer request {method!r}")
            reply = ("ok", handlers[method](*args), trainer.step)
        except Exception as e:
            reply = ("err", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}", trainer.step)
        conn.send(reply)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="trainer child process of a cell agent (internal)")
    p.add_argument("--fd", type=int, required=True, help="inherited socket to the agent")
    args = p.parse_args(argv)
    return serve(Connection(args.fd))


if __name__ == "__main__":
    sys.exit(main())
