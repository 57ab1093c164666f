"""The cell agent: MPI rank r >= 1 (cell r - 1), owner of one cell's engine and trainer.

    mpiexec -n 1+N python -m gyre.sched.cell_agent --run-dir DIR --model DIR [--config FILE]
        [--engine-key-file FILE] [section.key=value ...]        # ranks >= 1; rank 0 is the head

The agent starts its engine (through the one engine seam, gyre.engine.launch.start_cell_engine)
and its trainer: ranks of gyre.train.rank over the cell's nodes (an srun step under Slurm, local
processes otherwise), offloaded since cells start in rollout. It sends Event ``hello``, then obeys
the head's commands one at a time (typed, gyre.sched.protocol; a dispatch table picks the
handler). Between commands it sends a heartbeat every ``HEARTBEAT_S`` and watches its children:
a dead engine is restarted (Event ``engine_restarted``), a dead trainer is restarted from the
latest checkpoint it was told about (Event ``trainer_restarted``) and the micro-batches whose
gradients died with it are reported ``lost``. Every failing command is answered with
``ok=False`` and the reason; the agent itself only ends on ``stop``.

Gradients stay in the trainer ranks: ``done`` = micro-batches trained this step, ``held_mbs`` =
those already summed over the cell (prepare_reduce, a role switch), ``lost`` = those whose
gradients died with a trainer. The reduce goes over torch.distributed groups among the trainer
ranks of the participant cells (gyre.train.groups); this link carries control only. The agent of
cell 0 serves the job's TCPStore those groups meet in and tells the other agents where it is.

Commit order of a reduce: every participant sums; the leader applies, exports (one piece per
rank) and checkpoints, then sets the step's commit key; the other train cells apply only after
the commit. A death before the commit changes nothing anywhere (reply ``retry``); after it, a
cell whose trainer died loads the leader's checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

from gyre import faults
from gyre.config import EngineBackend, GyreConfig, env, load_config, trainer_config
from gyre.fsio import atomic_write_json
from gyre.sched import mpi_link
from gyre.sched.protocol import (TAG_STORE, Command, Event, PrepareReduce, PushWeights, Reduce, Reply, Role, Stop,
                                 ToRollout, ToTrain, Train, reply_for)
from gyre.train.worker import TrainerDied, TrainerError, TrainerProcess

HEARTBEAT_S = 1.0
POLL_S = 0.02            # command poll granularity while idle
ENGINE_CALL_S = 120.0    # bound on one engine admin call (weight loads included)
DRAIN_S = 30.0           # default bound on a release the engine refuses while requests run
REDUCE_S = 600.0         # bound on waiting for the other participants of a reduce
ENGINE_RETRY_S = 5.0     # wait between attempts to restart a failed engine
STORE_WAIT_S = 300.0     # bound on waiting for cell 0's agent to say where the store is
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
        self.role = Role.ROLLOUT
        self.version = 0                      # newest policy version this cell has heard of
        self.checkpoint: str | None = None    # newest trainer checkpoint this cell has heard of
        self.engine = None                    # gyre.engine.launch.EngineHandle
        self.admin = None                     # gyre.engine.sglang_api.SGLangAdmin
        self.engine_weights = str(self.model_dir)  # what the engine serves (restarts load it)
        self.engine_version = "0"
        self._engine_retry_at = 0.0
        self.trainer: TrainerProcess | None = None
        self.trainer_gen = 0
        self.trainer_hosts: list[str] = []
        self.store = None                     # the job's TCPStore (served here on cell 0)
        self.store_addr: tuple[str, int] | None = None
        self.done: list = []
        self.held_mbs: list = []
        self.lost: list = []
        self._attempts: dict[tuple, int] = {}
        self._last_sent = 0.0
        self._beat_req = None     # the last heartbeat's isend, while the head has not taken it
        self.slurm = self._slurm_layout()
        from gyre.engine.reaper import ProcessList
        self.pids = ProcessList(self.run_dir, f"cell{self.cell}")  # reaped by a --resume if this agent dies

    # --- where the cell's processes run -----------------------------------------------------
    def _slurm_layout(self) -> dict | None:
        """Under Slurm: this cell's nodes (run_dir/slurm.json, written by `prepare` for this job)."""
        job = env("SLURM_JOB_ID")
        path = self.run_dir / "slurm.json"
        if not job or not path.exists():
            return None
        rec = json.loads(path.read_text())
        cells = rec.get("cells", [])
        if self.cell >= len(cells):
            return None
        from gyre.cluster.slurm import cell_step_prefix

        return {"nodes": list(cells[self.cell]["nodes"]), "srun": cell_step_prefix()}

    def _advertise(self) -> str:
        return socket.getfqdn() if (self.slurm or self.cfg.engine.host in ("0.0.0.0", "")) else "127.0.0.1"

    def trainer_ranks(self) -> int:
        if self.slurm is None:
            return self.cfg.train.local_ranks
        import torch

        per_node = self.cfg.sched.gpus_per_node if torch.cuda.is_available() and self.cfg.sched.gpus_per_node else 1
        return per_node * len(self.slurm["nodes"])

    def _srun(self) -> list[str] | None:
        if self.slurm is None:
            return None
        # a step of its own inside the job, sharing the nodes with the agents' and engines' steps
        return list(self.slurm["srun"])

    # --- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        self._share_store()
        self.trainer = self._new_trainer()  # loads while the engine starts
        self._start_engine()
        self.trainer.wait_ready(on_wait=self._beat)
        self.trainer_hosts = self.trainer.hostnames()
        layout = {"cell": self.cell, "agent_host": socket.gethostname(), "trainer_ranks": self.trainer.ranks,
                  "trainer_hosts": self.trainer_hosts, "engine_backend": self.engine.backend,
                  "engine_nodes": list(self.engine.nodes) or [socket.gethostname()],
                  "nodes": self.slurm["nodes"] if self.slurm else [socket.gethostname()]}
        # what runs where, for operators and the dev-cluster tests (the head's files are its own)
        atomic_write_json(self.run_dir / "cells" / f"cell{self.cell}.json", layout)
        self._event("hello", engine_url=self.engine.url, hostname=socket.gethostname(), pid=os.getpid(),
                    engine_pid=self.engine.proc.pid, trainer_pid=self.trainer.pid, version=self.version, **layout)

    def _share_store(self) -> None:
        """Cell 0 serves the job's TCPStore and sends its address to the other agents (control)."""
        from gyre.train.groups import connect_store, serve_store

        if self.cell == 0:
            self.store = serve_store()
            self.store_addr = (self._advertise(), self.store.port)
            for rank in range(2, self.comm.Get_size()):
                mpi_link.send(self.comm, self.store_addr, rank, TAG_STORE)
        else:
            addr = mpi_link.poll(self.comm, mpi_link.cell_rank(0), TAG_STORE, STORE_WAIT_S)
            if addr is None:
                raise RuntimeError(f"cell 0 did not say where the trainer store is within {STORE_WAIT_S:.0f} s")
            self.store_addr = tuple(addr)
            self.store = connect_store(*self.store_addr)

    def run(self) -> int:
        """Serve commands until ``stop``; returns the exit code."""
        while True:
            cmd = mpi_link.recv_command(self.comm, POLL_S)
            if cmd is not None:
                faults.hit("agent", "command")
                mpi_link.send_reply(self.comm, self.handle(cmd))
                self._last_sent = time.monotonic()
                if isinstance(cmd, Stop):
                    return 0
            try:
                self._watch()
            except Exception as e:  # noqa: BLE001 - e.g. a trainer that cannot be started again
                self._event("fatal", what="watch", error=f"{type(e).__name__}: {e}")
                time.sleep(ENGINE_RETRY_S)  # do not spin on a persistent failure
            self._beat()

    def close(self) -> None:
        """End both children (idempotent)."""
        trainer, engine = self.trainer, self.engine
        self.trainer = self.engine = self.admin = None
        if trainer is not None:
            trainer.close()
        if engine is not None:
            engine.stop()
        self.pids.close()

    # --- dispatch ---------------------------------------------------------------------------
    def handlers(self) -> dict:
        return {ToTrain: self._to_train, ToRollout: self._to_rollout, PushWeights: self._push_weights,
                Train: self._train, PrepareReduce: self._prepare_reduce, Reduce: self._reduce, Stop: self._stop}

    def handle(self, cmd: Command) -> Reply:
        phases: dict[str, float] = {}
        reply = reply_for(cmd, self.cell, phases=phases)
        t0 = time.perf_counter()
        try:
            handler = self.handlers().get(type(cmd))
            if handler is None:
                raise CommandError(f"unknown command {type(cmd).__name__}")
            handler(cmd, reply, phases)
        except CommandError as e:
            reply.ok, reply.error = False, str(e)
        except TrainerDied as e:
            self._trainer_died(str(e))
            reply.ok, reply.error = False, f"{e}; restarted it"
        except Exception as e:  # noqa: BLE001 - an unexpected failure costs this command only
            reply.ok = False
            reply.error = f"{cmd.kind} failed: {type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"
        if hasattr(reply, "lost"):  # told once: the head hands them out again
            reply.lost = sorted(set(reply.lost) | set(self.lost))
            self.lost = []
        phases["total"] = time.perf_counter() - t0
        reply.role = self.role
        return reply

    # --- commands ---------------------------------------------------------------------------
    def _to_train(self, c: ToTrain, rep, phases: dict) -> None:
        self._heard(c.version, c.checkpoint)
        if self.role is Role.TRAIN:  # catch up (it may have sat out a reduce)
            self._ensure_trainer()
            with timed(phases, "load"):
                self._catch_up(c.version)
            rep.already, rep.version = True, self.trainer.step
            return
        self._ensure_engine()
        self._ensure_trainer()  # before the role changes: a restarted trainer starts offloaded
        with timed(phases, "drain"):
            rep.aborted = self._drain_and_release(c.drain_timeout_s, phases)
        self.role = Role.TRAIN  # from here the engine holds no memory
        with timed(phases, "restore"):
            self.trainer.restore(on_wait=self._beat)
        with timed(phases, "load"):
            self._catch_up(c.version)
        rep.version, rep.trainer_pid = self.trainer.step, self.trainer.pid

    def _to_rollout(self, c: ToRollout, rep, phases: dict) -> None:
        if c.version is not None:
            self._heard(int(c.version), None)
        if self.role is Role.ROLLOUT:
            with timed(phases, "load"):
                self._load_weights(c.version, c.weights)
            rep.already, rep.weight_version = True, self.engine_version
            return
        self._ensure_trainer()
        try:
            with timed(phases, "stash"):
                self._stash(self.trainer.step)
            with timed(phases, "offload"):
                self.trainer.offload(on_wait=self._beat)
            self.role = Role.ROLLOUT
        except TrainerDied as e:  # the switch goes on: a new trainer starts offloaded, the head
            self.role = Role.ROLLOUT  # hears of the lost micro-batches at prepare_reduce
            self._trainer_died(str(e))
        with timed(phases, "resume"):
            if not self._ensure_engine():  # a restarted engine holds its memory already
                self._admin("resume_memory_occupation", MEMORY_TAGS)
        with timed(phases, "load"):
            self._load_weights(c.version, c.weights)
        rep.weight_version, rep.held_mbs = self.engine_version, list(self.held_mbs)

    def _push_weights(self, c: PushWeights, rep, phases: dict) -> None:
        if self.role is not Role.ROLLOUT:
            raise CommandError("push_weights: the cell is in train role (its engine holds no memory)")
        self._heard(int(c.version), None)
        self._ensure_engine()
        with timed(phases, "load"):
            self._load_weights(c.version, c.weights)
        rep.weight_version = self.engine_version

    def _train(self, c: Train, rep, phases: dict) -> None:
        if self.role is not Role.TRAIN:
            raise CommandError(f"train: the cell is in {self.role.value} role; send to_train first")
        self._ensure_trainer()
        if self.trainer.step < c.step:  # it died applying the last step: the leader's checkpoint has it
            with timed(phases, "load"):
                self._catch_up(c.step)
        if self.trainer.step != c.step:
            raise CommandError(f"train: micro-batch {c.mb_id} is for step {c.step} but the trainer "
                               f"is at step {self.trainer.step}")
        with timed(phases, "forward_backward"):
            try:
                rep.stats = self.trainer.forward_backward(c.batch, c.step, on_wait=self._beat)
            except TrainerDied:
                self.done.append(c.mb_id)  # its gradients died with the others of this step
                raise
        self.done.append(c.mb_id)
        rep.mb_id = c.mb_id

    def _prepare_reduce(self, c: PrepareReduce, rep, phases: dict) -> None:
        self._ensure_trainer()
        with timed(phases, "stash"):
            self._stash(c.step)
        rep.mb_ids, rep.lost = list(self.held_mbs), list(self.lost)

    def _reduce(self, c: Reduce, rep, phases: dict) -> None:
        from gyre.train.groups import abort_attempt, attempt_key

        members = sorted(int(x) for x in c.participants)
        if self.cell not in members:
            raise CommandError(f"reduce: cell {self.cell} is not among the participants {members}")
        key = (c.step, tuple(members))
        attempt = self._attempts[key] = self._attempts.get(key, 0) + 1
        base = attempt_key(c.step, members, attempt)
        leader = self.cell == c.leader
        rep.mb_ids, rep.version = list(self.held_mbs), c.step

        def fail(why: str, died: bool) -> None:
            """Nothing was applied anywhere: the others stop waiting, the head repeats the step."""
            abort_attempt(self.store, c.step, members, attempt, f"cell {self.cell}: {why.splitlines()[0]}")
            if died:
                self._trainer_died(why)
            rep.ok, rep.retry, rep.error, rep.lost = False, True, why, list(self.lost)

        # 1. sum over the participants (every rank of every participant cell)
        try:
            self._ensure_trainer()
            if self.lost:  # its gradients died before this reduce: the head must hand them out again
                return fail(f"reduce: micro-batches {self.lost} of cell {self.cell} were lost", False)
            with timed(phases, "allreduce"):
                info = self.trainer.reduce(c.step, members, attempt, on_wait=self._beat,
                                           timeout_s=c.timeout_s)
            rep.group_form_ms, rep.group_cached = info.form_ms, info.cached
            rep.grad_norm = info.grad_norm_total
        except TrainerDied as e:
            return fail(str(e), True)
        except TrainerError as e:  # another member died, or did not come
            return fail(str(e), False)
        # 2. the leader commits the step: apply, export, checkpoint
        commit = base + "/commit"
        if leader:
            if self.role is not Role.TRAIN:
                return fail(f"reduce: leader cell {self.cell} is not in train role", False)
            try:
                with timed(phases, "apply"):
                    stats = self.trainer.apply(c.step, on_wait=self._beat)
                with timed(phases, "export"):
                    rep.weights = self.trainer.export_weights(c.weights_dir, stats.step, on_wait=self._beat)
                with timed(phases, "checkpoint"):
                    rep.checkpoint = self.trainer.save_checkpoint(c.checkpoint_dir, on_wait=self._beat)
            except TrainerDied as e:
                return fail(str(e), True)
            except TrainerError as e:
                return fail(str(e), False)
            rep.grad_norm = stats.grad_norm
            self.store.set(commit, "1")
        else:
            with timed(phases, "commit_wait"):
                if not self._wait_commit(commit, base + "/abort", c.timeout_s):
                    return fail(f"reduce: the leader (cell {c.leader}) did not commit step {c.step}", False)
            if self.role is Role.TRAIN:
                try:
                    with timed(phases, "apply"):
                        rep.grad_norm = self.trainer.apply(c.step, on_wait=self._beat).grad_norm
                except TrainerDied as e:  # the step is committed: the new trainer loads the leader's checkpoint
                    self._trainer_died(str(e), lose=False)
                    self._heard(c.step + 1, c.checkpoint_dir)
                    with timed(phases, "load"):
                        self._catch_up(c.step + 1)
                    rep.caught_up = True
        # the step is over for this cell
        self.held_mbs, self.done = [], []
        self.version = max(self.version, c.step + 1)
        self._heard(c.step + 1, c.checkpoint_dir)
        rep.version = c.step + 1

    def _wait_commit(self, commit: str, abort: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.store.check([commit]):
            if self.store.check([abort]) or time.monotonic() > deadline:
                return False
            self._beat()
            time.sleep(0.002)
        return True

    def _stop(self, c: Stop, rep, phases: dict) -> None:
        with timed(phases, "close"):
            self.close()

    # --- gradients --------------------------------------------------------------------------
    def _stash(self, step: int | None = None) -> None:
        """Sum this step's gradients over the cell's ranks (they stay there, between steps)."""
        if not self.done:
            return
        self.trainer.stash(self.version if step is None else step, on_wait=self._beat)
        self.held_mbs += self.done
        self.done = []

    # --- trainer ----------------------------------------------------------------------------
    def _new_trainer(self) -> TrainerProcess:
        # in rollout the trainer waits offloaded; in train it must be ready to compute
        self.trainer_gen += 1
        slurm = self.slurm
        trainer = TrainerProcess(trainer_config(self.cfg), self.model_dir, seed=self.cfg.run.seed,
                                 offloaded=self.role is Role.ROLLOUT, checkpoint=self.checkpoint,
                                 cell=self.cell, gen=self.trainer_gen, ranks=self.trainer_ranks(),
                                 store=self.store_addr, advertise=self._advertise(), srun=self._srun(),
                                 nodes=slurm["nodes"] if slurm else ())
        self.pids.add("trainer", [p.pid for p in trainer.procs])
        return trainer

    def _ensure_trainer(self) -> None:
        if not self.trainer.alive():
            self._trainer_died("a trainer process exited")
        self.trainer.wait_ready(on_wait=self._beat)

    def _trainer_died(self, reason: str, lose: bool = True) -> None:
        """Restart the trainer; the micro-batches whose gradients it held join ``lost``."""
        if lose:
            self.lost += self.held_mbs + self.done
        self.held_mbs, self.done = [], []
        old = self.trainer.pid
        with contextlib.suppress(Exception):
            self.trainer.kill()
        self.trainer = self._new_trainer()
        self._event("trainer_restarted", reason=reason, lost=list(self.lost), old_pid=old,
                    trainer_pid=self.trainer.pid, checkpoint=self.checkpoint)

    def _catch_up(self, version: int) -> None:
        if self.trainer.step is None:
            self.trainer.wait_ready(on_wait=self._beat)
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
        """Start an engine serving what the last one served, through the one engine seam. It
        boots from the model directory (exported weights carry no tokenizer), then loads the
        current weights if they differ."""
        from gyre.engine.launch import start_cell_engine
        from gyre.engine.sglang_api import SGLangAdmin

        slurm = self.slurm
        srun = None
        port = 0
        if slurm is not None and self.cfg.engine.backend == EngineBackend.SGLANG:
            srun = list(slurm["srun"])
            port = self.cfg.engine.port + self.cell
        self.engine = start_cell_engine(self.cfg, self.model_dir, api_key=self.api_key,
                                        nodes=slurm["nodes"] if slurm else (), port=port, srun=srun,
                                        extra_args=["--weight-version", "0", *self._engine_args])
        self.pids.add("engine", self.engine.pids, self.engine.key_file)
        self.admin = SGLangAdmin(self.engine.url, self.api_key, timeout_s=ENGINE_CALL_S)
        if self.engine_version != "0":
            self._admin("update_weights_from_disk", self.engine_weights, self.engine_version)

    def _admin(self, call: str, *args, **kw):
        return getattr(self.admin, call)(*args, **kw)

    def _ensure_engine(self) -> bool:
        """Restart the engine if it died; True if it did. Raises if no engine can be had."""
        if self.engine is not None and self.engine.alive():
            return False
        old = self.engine
        code = old.proc.poll() if old is not None else None
        if old is not None:
            old.stop(timeout=2)
        self.engine = self.admin = None
        try:
            self._start_engine()
            if self.role is Role.TRAIN:  # back to where the old one was: no memory held
                self._admin("release_memory_occupation", MEMORY_TAGS)
        except Exception as e:
            if self.engine is not None:  # half started (e.g. the weights failed to load): not usable
                self.engine.stop(timeout=2)
                self.engine = None
            self._engine_retry_at = time.monotonic() + ENGINE_RETRY_S
            self._event("fatal", what="engine", error=f"cannot restart the engine: {e}")
            raise CommandError(f"the engine died and could not be restarted: {e}") from e
        self._event("engine_restarted", engine_url=self.engine.url, engine_pid=self.engine.proc.pid,
                    old_url=old.url if old else None, exit_code=code, role=self.role.value,
                    weight_version=self.engine_version)
        return True

    def _drain_and_release(self, timeout_s: float, phases: dict) -> int:
        """Release the engine's memory with SGLang's documented API only. The head took the cell
        out of the router and aborted the router's requests there first (it knows the in-flight
        count; the engine's /health tells nothing); whatever still runs is aborted here, and
        a release the engine refuses while requests finish is retried within ``timeout_s``."""
        from gyre.engine.sglang_api import SGLangAPIError

        self._admin("abort_request", abort_all=True)
        deadline = time.monotonic() + timeout_s
        tries = 0
        while True:
            tries += 1
            try:
                with timed(phases, "release"):
                    self._admin("release_memory_occupation", MEMORY_TAGS)
                return tries - 1
            except SGLangAPIError as e:
                if time.monotonic() > deadline:
                    raise CommandError(f"the engine refused to release its memory for {timeout_s:.0f} s: {e}") from e
                self._admin("abort_request", abort_all=True)  # aborted requests end at their next step
                self._beat()
                time.sleep(0.01)

    def _load_weights(self, version, weights) -> None:
        if version is None or str(version) == self.engine_version:
            return
        if not weights:
            raise CommandError(f"the engine serves version {self.engine_version}; version {version} "
                               "needs its weights directory")
        self._admin("update_weights_from_disk", str(weights), str(version))
        self.engine_weights, self.engine_version = str(weights), str(version)

    # --- watching and heartbeats ------------------------------------------------------------
    def _watch(self) -> None:
        if self.trainer is not None and not self.trainer.alive():
            self._trainer_died("a trainer process exited")
        if (self.engine is None or not self.engine.alive()) and time.monotonic() >= self._engine_retry_at:
            with contextlib.suppress(CommandError):  # reported as Event fatal; retried later
                self._ensure_engine()

    def _beat(self) -> None:
        if time.monotonic() - self._last_sent < HEARTBEAT_S:
            return
        if self._beat_req is not None and not self._beat_req.Test():
            return  # the head has not taken the last one (busy, or gone): never block on a beat
        info = dict(role=self.role.value, trainer_step=self.trainer.step if self.trainer else None,
                    engine_version=self.engine_version, engine_url=self.engine.url if self.engine else None,
                    engine_pid=self.engine.proc.pid if self.engine else None,
                    trainer_pid=self.trainer.pid if self.trainer else None)
        self._beat_req = mpi_link.isend_event(self.comm, Event(cell=self.cell, kind="heartbeat", info=info))
        self._last_sent = time.monotonic()

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
        stopped = isinstance(cmd, Stop)
        mpi_link.send_reply(comm, reply_for(cmd, cell, ok=stopped,
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
