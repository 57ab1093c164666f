"""The cell agent: MPI rank r >= 1 (cell r - 1), owner of one cell's engine and trainer.

    mpiexec -n 1+N python -m gyre.sched.cell_agent --run-dir DIR --model DIR [--config FILE]
        [--engine-key-file FILE] [section.key=value ...]        # ranks >= 1; rank 0 is the head

The agent starts its engine (an HTTP subprocess) and its trainer (a child process, offloaded:
cells start in rollout), sends Event ``hello``, then obeys the head's commands one at a time
(semantics in :mod:`gyre.sched.protocol`). Between commands it sends a heartbeat every
``HEARTBEAT_S`` and watches its children: a dead engine is restarted (new port, current weights,
Event ``engine_restarted``), a dead trainer is restarted from the latest checkpoint it was told
about (Event ``trainer_restarted``) and the micro-batches whose gradients died with it are
reported ``lost``. Every failing command is answered with ``ok=False`` and the reason; the agent
itself only ends on ``stop``.

Gradient bookkeeping of one step: ``done`` = micro-batches whose gradients sit in the trainer
process, ``held`` = gradients already pulled into the agent (a role switch or prepare_reduce),
``lost`` = micro-batches whose gradients died with a trainer. A reduce sums ``held`` over the
participants and starts the next step.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
import traceback
import urllib.request
from pathlib import Path

import numpy as np

from gyre.config import GyreConfig, env, load_config
from gyre.engine.client import EngineClient
from gyre.engine.launch import EngineProcess, start_engine
from gyre.sched import mpi_link
from gyre.sched.protocol import TAG_REDUCE, Command, Event, Reply
from gyre.train.worker import TrainerDied, TrainerProcess

HEARTBEAT_S = 1.0
POLL_S = 0.02            # command poll granularity while idle
ENGINE_CALL_S = 120.0    # bound on one engine admin call (weight loads included)
DRAIN_S = 30.0           # default bound on waiting for in-flight requests before a release
REDUCE_S = 600.0         # bound on waiting for the other participants of a reduce
ENGINE_RETRY_S = 5.0     # wait between attempts to restart a failed engine
MEMORY_TAGS = ["kv_cache", "weights"]


class CommandError(RuntimeError):
    """A command cannot be carried out; the message goes to the head as Reply.error."""


@contextlib.contextmanager
def timed(phases: dict, name: str):
    t0 = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0


def read_key_file(path: str | os.PathLike) -> str:
    p = Path(path)
    mode = p.stat().st_mode & 0o777
    if mode & 0o077:
        raise PermissionError(f"engine key file {p} is readable by others (mode {mode:o}); chmod 600 it")
    key = p.read_text(encoding="utf-8").strip()
    if not key:
        raise ValueError(f"engine key file {p} is empty")
    return key


class CellAgent:
    def __init__(self, comm, cfg: GyreConfig, *, run_dir: str | os.PathLike, model_dir: str | os.PathLike,
                 api_key: str, config_file: str | None = None, overrides: list[str] | None = None) -> None:
        self.comm = comm
        self.cell = mpi_link.rank_cell(comm.Get_rank())
        self.cfg, self.run_dir, self.model_dir = cfg, Path(run_dir), Path(model_dir)
        self.api_key = api_key
        self._engine_args = (["--config", config_file] if config_file else []) + \
            [a for o in overrides or [] for a in ("--set", o)]
        self.role = "rollout"
        self.version = 0                      # newest policy version this cell has heard of
        self.checkpoint: str | None = None    # newest trainer checkpoint this cell has heard of
        self.engine: EngineProcess | None = None
        self.client: EngineClient | None = None
        self.engine_weights = str(self.model_dir)  # what the engine serves (restarts load it)
        self.engine_version = "0"
        self._engine_retry_at = 0.0
        self.trainer: TrainerProcess | None = None
        self.n_grad = 0
        self.done: list = []
        self.held: np.ndarray | None = None
        self.held_mbs: list = []
        self.lost: list = []
        self._last_sent = 0.0
        self._loop = asyncio.new_event_loop()

    # --- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        self.trainer = self._new_trainer()  # loads while the engine starts
        self._start_engine()
        self.trainer.wait_ready()
        self.n_grad = self.trainer.num_grad_elements
        self._event("hello", engine_url=self.engine.url, hostname=socket.gethostname(), pid=os.getpid(),
                    cell=self.cell, engine_pid=self.engine.proc.pid, trainer_pid=self.trainer.pid,
                    version=self.version)

    def run(self) -> int:
        """Serve commands until ``stop``; returns the exit code."""
        while True:
            cmd = mpi_link.recv_command(self.comm, POLL_S)
            if cmd is not None:
                mpi_link.send_reply(self.comm, self.handle(cmd))
                self._last_sent = time.monotonic()
                if cmd.kind == "stop":
                    return 0
            try:
                self._watch()
            except Exception as e:  # noqa: BLE001 - e.g. a trainer that cannot be started again
                self._event("fatal", what="watch", error=f"{type(e).__name__}: {e}")
                time.sleep(ENGINE_RETRY_S)  # do not spin on a persistent failure
            self._beat()

    def close(self) -> None:
        """End both children (idempotent)."""
        trainer, engine, client = self.trainer, self.engine, self.client
        self.trainer = self.engine = self.client = None
        if trainer is not None:
            trainer.close()
        if engine is not None:
            engine.stop()
        if client is not None:
            self._loop.run_until_complete(client.close())

    # --- dispatch ---------------------------------------------------------------------------
    def handle(self, cmd: Command) -> Reply:
        phases: dict[str, float] = {}
        reply = Reply(seq=cmd.seq, cell=self.cell, kind=cmd.kind, ok=True, phases=phases)
        t0 = time.perf_counter()
        try:
            reply.info = getattr(self, f"_cmd_{cmd.kind}")(cmd.args, phases) or {}
        except CommandError as e:
            reply.ok, reply.error = False, str(e)
        except TrainerDied as e:
            self._trainer_died(str(e))
            reply.ok, reply.error = False, f"{e}; restarted it"
            reply.info = {"lost": list(self.lost)}
        except Exception as e:  # noqa: BLE001 - an unexpected failure costs this command only
            reply.ok = False
            reply.error = f"{cmd.kind} failed: {type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"
        phases["total"] = time.perf_counter() - t0
        reply.info.setdefault("role", self.role)
        return reply

    # --- commands ---------------------------------------------------------------------------
    def _cmd_to_train(self, a: dict, phases: dict) -> dict:
        version, ckpt = int(a.get("version", self.version)), a.get("checkpoint")
        self._heard(version, ckpt)
        if self.role == "train":  # catch up (it may have sat out a reduce)
            self._ensure_trainer()
            with timed(phases, "load"):
                self._catch_up(version)
            return {"already": True, "version": self.trainer.step}
        self._ensure_engine()
        self._ensure_trainer()  # before the role changes: a restarted trainer starts offloaded
        with timed(phases, "drain"):
            aborted = self._drain(float(a.get("drain_timeout_s", DRAIN_S)))
        with timed(phases, "release"):
            self._engine(self.client.release_memory(MEMORY_TAGS))
        self.role = "train"  # from here the engine holds no memory
        with timed(phases, "restore"):
            self.trainer.restore(on_wait=self._beat)
        with timed(phases, "load"):
            self._catch_up(version)
        return {"version": self.trainer.step, "aborted": aborted, "trainer_pid": self.trainer.pid}

    def _cmd_to_rollout(self, a: dict, phases: dict) -> dict:
        version, weights = a.get("version"), a.get("weights")
        if version is not None:
            self._heard(int(version), None)
        if self.role == "rollout":
            with timed(phases, "load"):
                self._load_weights(version, weights)
            return {"already": True, "weight_version": self.engine_version}
        self._ensure_trainer()
        with timed(phases, "stash"):
            self._stash()
        with timed(phases, "offload"):
            self.trainer.offload(on_wait=self._beat)
        self.role = "rollout"
        with timed(phases, "resume"):
            if not self._ensure_engine():  # a restarted engine holds its memory already
                self._engine(self.client.resume_memory(MEMORY_TAGS))
        with timed(phases, "load"):
            self._load_weights(version, weights)
        return {"weight_version": self.engine_version, "held_mbs": list(self.held_mbs)}

    def _cmd_push_weights(self, a: dict, phases: dict) -> dict:
        if self.role != "rollout":
            raise CommandError("push_weights: the cell is in train role (its engine holds no memory)")
        self._heard(int(a["version"]), None)
        self._ensure_engine()
        with timed(phases, "load"):
            self._load_weights(a["version"], a.get("weights"))
        return {"weight_version": self.engine_version}

    def _cmd_train(self, a: dict, phases: dict) -> dict:
        if self.role != "train":
            raise CommandError(f"train: the cell is in {self.role} role; send to_train first")
        mb_id = a["mb_id"]
        self._ensure_trainer()
        if "step" in a and int(a["step"]) != self.trainer.step:
            raise CommandError(f"train: micro-batch {mb_id} is for step {a['step']} but the trainer "
                               f"is at step {self.trainer.step}")
        with timed(phases, "forward_backward"):
            try:
                stats = self.trainer.forward_backward(a["batch"], on_wait=self._beat)
            except TrainerDied as e:
                self.done.append(mb_id)  # its gradients died with the others of this step
                raise e
        self.done.append(mb_id)
        return {"mb_id": mb_id, "stats": stats}

    def _cmd_prepare_reduce(self, a: dict, phases: dict) -> dict:
        self._ensure_trainer()
        with timed(phases, "pull"):
            self._stash()
        return {"mb_ids": list(self.held_mbs), "lost": list(self.lost)}

    def _cmd_reduce(self, a: dict, phases: dict) -> dict:
        step, participants, leader = int(a["step"]), sorted(int(c) for c in a["participants"]), int(a["leader"])
        if self.cell not in participants:
            raise CommandError(f"reduce: cell {self.cell} is not among the participants {participants}")
        # nothing may keep this cell out of the collective: the others would wait for it
        with timed(phases, "pull"):
            try:
                self._stash()  # a no-op when prepare_reduce came first, as it should
            except TrainerDied as e:
                self._trainer_died(str(e))
        local = self.held if self.held is not None else np.zeros(self.n_grad, np.float32)
        with timed(phases, "allreduce"):
            total = self._allreduce(local, participants, float(a.get("timeout_s", REDUCE_S)))
        info = {"version": step + 1, "mb_ids": list(self.held_mbs), "lost": list(self.lost),
                "grad_norm": float(np.linalg.norm(total.astype(np.float64)))}
        self.held, self.held_mbs, self.lost = None, [], []  # the step is over for this cell
        self.version = max(self.version, step + 1)
        if self.role != "train":  # it loads the new checkpoint when it next switches to train
            self._heard(step + 1, a.get("checkpoint_dir"))
            if self.cell == leader:
                raise CommandError(f"reduce: leader cell {leader} is not in train role")
            return info
        self._ensure_trainer()  # a restart here loads the checkpoint of `step`: still valid
        if self.trainer.step != step:
            raise CommandError(f"reduce: the trainer is at step {self.trainer.step}, not {step}; "
                               "the sum was not applied")
        with timed(phases, "apply"):
            stats = self.trainer.apply(total, on_wait=self._beat)
        info.update(grad_norm=stats["grad_norm"], version=stats["step"])
        if self.cell == leader:
            with timed(phases, "export"):
                info["weights"] = self.trainer.export_weights(a["weights_dir"], stats["step"], on_wait=self._beat)
            with timed(phases, "checkpoint"):
                info["checkpoint"] = self.trainer.save_checkpoint(a["checkpoint_dir"], on_wait=self._beat)
        # only now: a trainer restarted before the leader wrote it must not look for it
        self._heard(step + 1, a.get("checkpoint_dir"))
        return info

    def _cmd_stop(self, a: dict, phases: dict) -> dict:
        with timed(phases, "close"):
            self.close()
        return {}

    # --- gradients --------------------------------------------------------------------------
    def _stash(self) -> None:
        """Move this step's gradients from the trainer into the agent (they survive a trainer
        death and a role switch there)."""
        if not self.done:
            return
        g = self.trainer.grads(clear=True, on_wait=self._beat)
        self.held = g if self.held is None else self.held + g
        self.held_mbs += self.done
        self.done = []

    def _allreduce(self, local: np.ndarray, participants: list[int], timeout_s: float) -> np.ndarray:
        from mpi4py import MPI

        group = self.comm.Get_group().Incl([mpi_link.cell_rank(c) for c in participants])
        sub = self.comm.Create_group(group, tag=TAG_REDUCE)  # only the participants call this
        group.Free()
        total = np.empty_like(local)
        req = sub.Iallreduce(local, total, op=MPI.SUM)
        deadline = time.monotonic() + timeout_s
        while not req.Test():
            if time.monotonic() > deadline:
                # the collective cannot be cancelled: leave `sub` to it rather than free it
                raise CommandError(f"reduce: participants {participants} did not all join within "
                                   f"{timeout_s:.0f} s")
            self._beat()
            time.sleep(0.0005)
        sub.Free()
        return total

    # --- trainer ----------------------------------------------------------------------------
    def _new_trainer(self) -> TrainerProcess:
        # in rollout the trainer waits offloaded; in train it must be ready to compute
        return TrainerProcess(self.cfg.train, self.model_dir, seed=self.cfg.run.seed,
                              offloaded=self.role == "rollout", checkpoint=self.checkpoint)

    def _ensure_trainer(self) -> None:
        if not self.trainer.alive():
            self._trainer_died("the trainer process exited")
        self.trainer.wait_ready(on_wait=self._beat)

    def _trainer_died(self, reason: str) -> None:
        """Restart the trainer; the micro-batches whose gradients it held join ``lost``."""
        self.lost += self.done
        self.done = []
        old = self.trainer.pid
        with contextlib.suppress(Exception):
            self.trainer.kill()
        self.trainer = self._new_trainer()
        self._event("trainer_restarted", reason=reason, lost=list(self.lost), old_pid=old,
                    trainer_pid=self.trainer.pid, checkpoint=self.checkpoint)

    def _catch_up(self, version: int) -> None:
        if self.trainer.step < version:
            if not self.checkpoint:
                raise CommandError(f"the trainer is at step {self.trainer.step} but version {version} "
                                   "was asked for without a checkpoint")
            self.trainer.load_checkpoint(self.checkpoint, on_wait=self._beat)
            if self.trainer.step != version:
                raise CommandError(f"checkpoint {self.checkpoint} holds step {self.trainer.step}, "
                                   f"not version {version}")

    def _heard(self, version: int, checkpoint: str | None) -> None:
        self.version = max(self.version, version)
        if checkpoint:
            self.checkpoint = str(checkpoint)

    # --- engine -----------------------------------------------------------------------------
    def _start_engine(self) -> None:
        """Start an engine serving what the last one served. It boots from the model directory
        (exported weights carry no tokenizer), then loads the current weights if they differ."""
        if self.cfg.engine.backend == "sglang":  # GPU nodes: a real SGLang server (unchecked here)
            from gyre.engine.sglang_launch import SGLangSpec, start_sglang

            eng = start_sglang(SGLangSpec(str(self.model_dir), host=self.cfg.engine.host,
                                          port=self.cfg.engine.port + self.cell, api_key=self.api_key,
                                          tp=max(1, self.cfg.sched.gpus_per_node)))
        else:
            eng = start_engine(self.model_dir, port=0, api_key=self.api_key, host=self.cfg.engine.host,
                               extra_args=["--weight-version", "0", *self._engine_args])
        if self.cfg.engine.host in ("0.0.0.0", ""):  # reachable from the head's node
            eng.url = eng.url.replace("127.0.0.1", socket.getfqdn())
        self.engine = eng
        self.client = EngineClient(eng.url, self.api_key, timeout_s=ENGINE_CALL_S, connect_retries=1)
        if self.engine_version != "0":
            self._engine(self.client.update_weights_from_disk(self.engine_weights, self.engine_version))

    def _ensure_engine(self) -> bool:
        """Restart the engine if it died; True if it did. Raises if no engine can be had."""
        if self.engine is not None and self.engine.proc.poll() is None:
            return False
        old = self.engine
        code = old.proc.returncode if old is not None else None
        if old is not None:
            old.stop(timeout=2)
        if self.client is not None:
            self._loop.run_until_complete(self.client.close())
        self.engine = self.client = None
        try:
            self._start_engine()
            if self.role == "train":  # back to where the old one was: no memory held
                self._engine(self.client.release_memory(MEMORY_TAGS))
        except Exception as e:
            if self.engine is not None:  # half started (e.g. the weights failed to load): not usable
                self.engine.stop(timeout=2)
                self.engine = None
            self._engine_retry_at = time.monotonic() + ENGINE_RETRY_S
            self._event("fatal", what="engine", error=f"cannot restart the engine: {e}")
            raise CommandError(f"the engine died and could not be restarted: {e}") from e
        self._event("engine_restarted", engine_url=self.engine.url, engine_pid=self.engine.proc.pid,
                    old_url=old.url if old else None, exit_code=code, role=self.role,
                    weight_version=self.engine_version)
        return True

    def _engine(self, coro, timeout_s: float = ENGINE_CALL_S):
        return self._loop.run_until_complete(asyncio.wait_for(coro, timeout_s))

    def _engine_load(self) -> dict:
        req = urllib.request.Request(self.engine.url + "/health",
                                     headers={"Authorization": f"Bearer {self.api_key}"})
        with urllib.request.urlopen(req, timeout=5) as resp:
            return json.load(resp)

    def _drain(self, timeout_s: float) -> int:
        """Wait (bounded) until the engine runs nothing; then abort what is left. The head has
        taken the cell out of the router and aborted first, so this is normally instant."""
        deadline = time.monotonic() + timeout_s
        while True:
            load = self._engine_load()
            if load.get("running", 0) + load.get("queued", 0) == 0:
                return 0
            if time.monotonic() > deadline:
                break
            self._beat()
            time.sleep(0.01)
        n = int(self._engine(self.client.abort(abort_all=True)).get("aborted", 0))
        for _ in range(500):  # aborted requests end at their next decode step
            load = self._engine_load()
            if load.get("running", 0) + load.get("queued", 0) == 0:
                break
            time.sleep(0.01)
        return n

    def _load_weights(self, version, weights) -> None:
        if version is None or str(version) == self.engine_version:
            return
        if not weights:
            raise CommandError(f"the engine serves version {self.engine_version}; version {version} "
                               "needs its weights directory")
        self._engine(self.client.update_weights_from_disk(str(weights), str(version)))
        self.engine_weights, self.engine_version = str(weights), str(version)

    # --- watching and heartbeats ------------------------------------------------------------
    def _watch(self) -> None:
        if self.trainer is not None and not self.trainer.alive():
            self._trainer_died("the trainer process exited")
        if (self.engine is None or self.engine.proc.poll() is not None) and \
                time.monotonic() >= self._engine_retry_at:
            with contextlib.suppress(CommandError):  # reported as Event fatal; retried later
                self._ensure_engine()

    def _beat(self) -> None:
        if time.monotonic() - self._last_sent < HEARTBEAT_S:
            return
        self._event("heartbeat", role=self.role, trainer_step=self.trainer.step if self.trainer else None,
                    engine_version=self.engine_version, engine_url=self.engine.url if self.engine else None,
                    engine_pid=self.engine.proc.pid if self.engine else None,
                    trainer_pid=self.trainer.pid if self.trainer else None)

    def _event(self, kind: str, **info) -> None:
        mpi_link.send_event(self.comm, Event(cell=self.cell, kind=kind, info=info))
        self._last_sent = time.monotonic()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", required=True, help="the run directory (shared with the head)")
    p.add_argument("--model", required=True, help="initial model directory (transformers layout)")
    p.add_argument("--config", default=None, help="Gyre TOML config file")
    p.add_argument("--engine-key-file", default=None,
                   help="file (mode 600) holding the job's engine API key; default $GYRE_ENGINE_KEY_FILE")
    p.add_argument("overrides", nargs="*", help="section.key=value configuration overrides")


def serve_failed(comm, error: str) -> int:
    """A cell that could not start still answers (ok=False) until ``stop``: exiting early would
    make the MPI launcher end the whole job, head included."""
    cell = mpi_link.rank_cell(comm.Get_rank())
    while True:
        cmd = mpi_link.recv_command(comm, 1.0)
        if cmd is None:
            continue
        stopped = cmd.kind == "stop"
        mpi_link.send_reply(comm, Reply(seq=cmd.seq, cell=cell, kind=cmd.kind, ok=stopped,
                                        error="" if stopped else f"cell {cell} failed to start: {error}"))
        if stopped:
            return 0  # the failure went to the head as Event fatal; the head owns the job's status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gyre.sched.cell_agent", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    from mpi4py import MPI  # here, not at import: children that import this module stay MPI-free

    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 0:
        print("cell_agent: rank 0 is the head; run the agent on ranks >= 1", file=sys.stderr)
        return 2
    # srun/mpiexec end a job with SIGTERM: unwind, so that the engine and trainer go too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    agent = None
    try:
        cfg = load_config(args.config, args.overrides)
        key_file = args.engine_key_file or env("GYRE_ENGINE_KEY_FILE")
        if not key_file:
            raise ValueError("no engine key: give --engine-key-file or set GYRE_ENGINE_KEY_FILE")
        agent = CellAgent(comm, cfg, run_dir=args.run_dir, model_dir=args.model, api_key=read_key_file(key_file),
                          config_file=args.config, overrides=args.overrides)
        agent.start()
    except Exception as e:  # the head hears why instead of waiting for a hello that never comes
        error = f"{type(e).__name__}: {e}"
        print(f"cell_agent {comm.Get_rank() - 1}: cannot start: {error}", file=sys.stderr)
        if agent is not None:
            with contextlib.suppress(Exception):
                agent.close()
        mpi_link.send_event(comm, Event(cell=comm.Get_rank() - 1, kind="fatal",
                                        info={"what": "start", "error": error}))
        return serve_failed(comm, error)
    try:
        return agent.run()
    finally:
        with contextlib.suppress(Exception):
            agent.close()


if __name__ == "__main__":
    sys.exit(main())
