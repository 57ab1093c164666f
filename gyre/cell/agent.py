"""The cell agent: MPI rank r >= 1 (cell r - 1), owner of one cell's engine and trainer.

Started by ``gyre.cluster.main`` on ranks >= 1 (:mod:`gyre.cell.main` is its process entry),
with a :class:`~gyre.cell.placement.Placement` that says where the cell's processes run.
The agent starts its engine (:class:`~gyre.cell.engine.CellEngine`, through the one engine seam)
and its trainer: ranks of gyre.cell.trainer_rank over the cell's nodes (an srun step under Slurm, local
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
ranks of the participant cells (gyre.cell.groups); this link carries control only. The agent of
cell 0 serves the job's TCPStore those groups meet in and tells the other agents where it is.

Commit order of a reduce: every participant sums; the leader applies, exports (one piece per
rank) and checkpoints, then sets the step's commit key; the other train cells apply only after
the commit. A death before the commit changes nothing anywhere (reply ``retry``); after it, a
cell whose trainer died loads the leader's checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import traceback
from pathlib import Path

from gyre import faults
from gyre.cell import mpi_link
from gyre.cell.command import CommandError, timed
from gyre.cell.engine import CellEngine
from gyre.cell.placement import Placement
from gyre.config import GyreConfig, InitOptimizer, trainer_config
from gyre.engine.reaper import ProcessList
from gyre.fsio import atomic_write_json
from gyre.messages import dispatch_table, handler_for
from gyre.sched.protocol import (TAG_STORE, Command, Event, PrepareReduce, PushWeights, Reduce, Reply, Stop,
                                 ToRollout, ToTrain, Train, reply_for)
from gyre.sched.state import Role
from gyre.cell.groups import abort_attempt, attempt_key, connect_store, serve_store
from gyre.position import Position
from gyre.cell.trainer_process import TrainerDied, TrainerError, TrainerProcess

HEARTBEAT_S = 1.0
POLL_S = 0.02            # command poll granularity while idle
ENGINE_RETRY_S = 5.0     # wait between attempts to restart a failed engine
STORE_WAIT_S = 300.0     # bound on waiting for cell 0's agent to say where the store is


class CellAgent:
    def __init__(self, comm, cfg: GyreConfig, placement: Placement, *, run_dir: str | os.PathLike,
                 model_dir: str | os.PathLike, api_key: str, config_file: str | None = None,
                 overrides: list[str] | None = None) -> None:
        self.comm = comm
        self.cell = mpi_link.rank_cell(comm.Get_rank())
        self.cfg, self.placement, self.run_dir, self.model_dir = cfg, placement, Path(run_dir), Path(model_dir)
        self.role = Role.ROLLOUT
        self.version = 0                      # newest policy version this cell has heard of
        self.checkpoint: str | None = None    # newest trainer checkpoint this cell has heard of
        # model.init_optimizer = "carried": the optimizer of the step model.init_from was exported from
        self.init_state: str | None = None
        if cfg.model.init_optimizer == InitOptimizer.CARRIED:
            from gyre.train.export import carried_checkpoint  # torch: only when asked for

            self.init_state = carried_checkpoint(cfg.model.init_from)
        self.pids = ProcessList(self.run_dir, f"cell{self.cell}")  # reaped by a --resume if this agent dies
        engine_args = (["--config", config_file] if config_file else []) + \
            [a for o in overrides or [] for a in ("--set", o)]
        self.engine = CellEngine(cfg, self.model_dir, api_key=api_key, cell=self.cell, placement=placement,
                                 pids=self.pids, extra_args=engine_args)
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

    # --- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        faults.hit("agent", "start")
        self._share_store()
        self.trainer = self._new_trainer()  # loads while the engine starts
        self.engine.start()
        self.trainer.wait_ready(on_wait=self._beat)
        self.trainer_hosts = self.trainer.hostnames()
        layout = {"cell": self.cell, "agent_host": socket.gethostname(), "trainer_ranks": self.trainer.ranks,
                  "trainer_hosts": self.trainer_hosts, "engine_backend": self.engine.handle.backend,
                  "engine_nodes": list(self.engine.handle.nodes) or [socket.gethostname()],
                  "nodes": list(self.placement.nodes) or [socket.gethostname()]}
        # what runs where, for operators and the dev-cluster tests (the head's files are its own)
        atomic_write_json(self.run_dir / "cells" / f"cell{self.cell}.json", layout)
        self._event("hello", engine_url=self.engine.url, hostname=socket.gethostname(), pid=os.getpid(),
                    engine_pid=self.engine.pid, trainer_pid=self.trainer.pid, version=self.version, **layout)

    def _share_store(self) -> None:
        """Cell 0 serves the job's TCPStore and sends its address to the other agents (control)."""
        if self.cell == 0:
            self.store = serve_store()
            self.store_addr = (self.placement.advertise, self.store.port)
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
        trainer, self.trainer = self.trainer, None
        if trainer is not None:
            trainer.close()
        self.engine.stop()
        self.pids.close()

    # --- dispatch (the table, HANDLERS, follows the handlers) ---------------------------------
    def handle(self, cmd: Command) -> Reply:
        """This cell's reply to one command; an unknown type is refused as the trainer ranks refuse
        an unknown request (gyre.messages.handler_for)."""
        phases: dict[str, float] = {}
        reply = reply_for(cmd, self.cell, phases=phases)
        t0 = time.perf_counter()
        try:
            handler_for(self.HANDLERS, cmd, "command", CommandError)(self, cmd, reply, phases)
        except CommandError as e:
            reply.ok, reply.error = False, str(e)
        except TrainerDied as e:
            self._trainer_died(str(e))
            reply.ok, reply.error = False, f"{e}; restarted it"
        except Exception as e:  # noqa: BLE001 - an unexpected failure costs this command only
            reply.ok = False
            reply.error = f"{cmd.name} failed: {type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"
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
                self._catch_up(Position(c.version, c.update))
            rep.already, rep.version = True, self.trainer.step
            return
        self._ensure_engine()
        self._ensure_trainer()  # before the role changes: a restarted trainer starts offloaded
        with timed(phases, "drain"):
            rep.aborted = self.engine.drain_and_release(c.drain_timeout_s, phases, on_wait=self._beat)
        self.role = Role.TRAIN  # from here the engine holds no memory
        with timed(phases, "restore"):
            self.trainer.restore(on_wait=self._beat)
        with timed(phases, "load"):
            self._catch_up(Position(c.version, c.update))
        rep.version, rep.trainer_pid = self.trainer.step, self.trainer.pid

    def _to_rollout(self, c: ToRollout, rep, phases: dict) -> None:
        if c.version is not None:
            self._heard(int(c.version), None)
        if self.role is Role.ROLLOUT:
            with timed(phases, "load"):
                self.engine.load(c.version, c.weights)
            rep.already, rep.weight_version = True, self.engine.version
            return
        self._ensure_trainer()
        try:
            with timed(phases, "stash"):
                self._stash(self.trainer.step, self.trainer.update)
            with timed(phases, "offload"):
                self.trainer.offload(on_wait=self._beat)
            self.role = Role.ROLLOUT
        except TrainerDied as e:  # the switch goes on: a new trainer starts offloaded, the head
            self.role = Role.ROLLOUT  # hears of the lost micro-batches at prepare_reduce
            self._trainer_died(str(e))
        with timed(phases, "resume"):
            if not self._ensure_engine():  # a restarted engine holds its memory already
                self.engine.resume()
        with timed(phases, "load"):
            self.engine.load(c.version, c.weights)
        rep.weight_version, rep.held_mbs = self.engine.version, list(self.held_mbs)

    def _push_weights(self, c: PushWeights, rep, phases: dict) -> None:
        if self.role is not Role.ROLLOUT:
            raise CommandError("push_weights: the cell is in train role (its engine holds no memory)")
        self._heard(int(c.version), None)
        self._ensure_engine()
        with timed(phases, "load"):
            self.engine.load(c.version, c.weights)
        rep.weight_version = self.engine.version

    def _train(self, c: Train, rep, phases: dict) -> None:
        if self.role is not Role.TRAIN:
            raise CommandError(f"train: the cell is in {self.role.value} role; send to_train first")
        self._ensure_trainer()
        at, want = self.trainer.position, Position(c.step, c.update)
        if at < want:  # it died applying the last update: the leader's checkpoint has it
            with timed(phases, "load"):
                self._catch_up(want)
            at = self.trainer.position
        if at != want:
            raise CommandError(f"train: micro-batch {c.mb_id} is for step {c.step} update {c.update} but the "
                               f"trainer is at step {at.step} update {at.update}")
        if c.prox:  # pi_prox of a later minibatch: no gradient, nothing held
            with timed(phases, "prox"):
                rep.logprobs = [float(x) for x in self.trainer.logprobs(c.batch, on_wait=self._beat)]
            rep.mb_id = c.mb_id
            return
        with timed(phases, "forward_backward"):
            try:
                rep.stats = self.trainer.forward_backward(c.batch, c.step, c.update, on_wait=self._beat)
            except TrainerDied:
                self.done.append(c.mb_id)  # its gradients died with the others of this step
                raise
        self.done.append(c.mb_id)
        rep.mb_id = c.mb_id

    def _prepare_reduce(self, c: PrepareReduce, rep, phases: dict) -> None:
        self._ensure_trainer()
        with timed(phases, "stash"):
            self._stash(c.step, c.update)
        rep.mb_ids, rep.lost = list(self.held_mbs), list(self.lost)

    def _reduce(self, c: Reduce, rep, phases: dict) -> None:
        members = sorted(int(x) for x in c.participants)
        if self.cell not in members:
            raise CommandError(f"reduce: cell {self.cell} is not among the participants {members}")
        key = (c.step, c.update, tuple(members))
        attempt = self._attempts[key] = self._attempts.get(key, 0) + 1
        here = Position(c.step, c.update)
        base = attempt_key(here, members, attempt)
        leader = self.cell == c.leader
        rep.mb_ids, rep.version = list(self.held_mbs), c.step
        after = here.after(c.final)  # the trainer's place once applied

        def fail(why: str, died: bool) -> None:
            """Nothing was applied anywhere: the others stop waiting, the head repeats the step."""
            abort_attempt(self.store, here, members, attempt, f"cell {self.cell}: {why.splitlines()[0]}")
            if died:
                self._trainer_died(why)
            rep.ok, rep.retry, rep.error, rep.lost = False, True, why, list(self.lost)

        # 1. sum over the participants (every rank of every participant cell)
        try:
            self._ensure_trainer()
            if self.lost:  # its gradients died before this reduce: the head must hand them out again
                return fail(f"reduce: micro-batches {self.lost} of cell {self.cell} were lost", False)
            with timed(phases, "allreduce"):
                info = self.trainer.reduce(c.step, members, attempt, c.update, on_wait=self._beat,
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
                    stats = self.trainer.apply(c.step, c.update, c.final, on_wait=self._beat)
                if c.final:  # engines load whole steps only
                    with timed(phases, "export"):
                        rep.weights = self.trainer.export_weights(c.weights_dir, stats.step, on_wait=self._beat)
                with timed(phases, "checkpoint"):  # every update: a trainer that dies later resumes from it
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
                        rep.grad_norm = self.trainer.apply(c.step, c.update, c.final, on_wait=self._beat).grad_norm
                except TrainerDied as e:  # the update is committed: the new trainer loads the leader's checkpoint
                    self._trainer_died(str(e), lose=False)
                    self._heard(after.step, c.checkpoint_dir)
                    with timed(phases, "load"):
                        self._catch_up(after)
                    rep.caught_up = True
        # the update is over for this cell
        self.held_mbs, self.done = [], []
        self._heard(after.step, c.checkpoint_dir)
        rep.version = after.step

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

    # command type -> handler (gyre.messages: the trainer ranks' table of requests is built alike)
    HANDLERS = dispatch_table({ToTrain: _to_train, ToRollout: _to_rollout, PushWeights: _push_weights, Train: _train,
                               PrepareReduce: _prepare_reduce, Reduce: _reduce, Stop: _stop})

    # --- gradients --------------------------------------------------------------------------
    def _stash(self, step: int, update: int = 0) -> None:
        """Sum this update's gradients over the cell's ranks (they stay there, between steps)."""
        if not self.done:
            return
        self.trainer.stash(step, update, on_wait=self._beat)
        self.held_mbs += self.done
        self.done = []

    # --- trainer ----------------------------------------------------------------------------
    def _new_trainer(self) -> TrainerProcess:
        # in rollout the trainer waits offloaded; in train it must be ready to compute
        self.trainer_gen += 1
        where = self.placement
        trainer = TrainerProcess(trainer_config(self.cfg), self.model_dir, seed=self.cfg.run.seed,
                                 offloaded=self.role is Role.ROLLOUT, checkpoint=self.checkpoint,
                                 init_state=self.init_state,
                                 cell=self.cell, gen=self.trainer_gen, ranks=where.trainer_ranks,
                                 store=self.store_addr, advertise=where.advertise,
                                 srun=list(where.srun) if where.in_slurm_step else None, nodes=where.nodes)
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

    def _catch_up(self, want: Position) -> None:
        """Bring the trainer to ``want`` (the newest checkpoint heard of holds exactly that)."""
        if self.trainer.step is None:
            self.trainer.wait_ready(on_wait=self._beat)
        if self.trainer.position < want:
            if not self.checkpoint:
                raise CommandError(f"the trainer is at step {self.trainer.step} but version {want.step} "
                                   "was asked for without a checkpoint")
            self.trainer.load_checkpoint(self.checkpoint, on_wait=self._beat)
            if self.trainer.position != want:
                raise CommandError(f"checkpoint {self.checkpoint} holds step {self.trainer.step} update "
                                   f"{self.trainer.update}, not version {want.step} update {want.update}")

    def _heard(self, version: int, checkpoint: str | None) -> None:
        self.version = max(self.version, version)
        if checkpoint:
            self.checkpoint = str(checkpoint)

    # --- engine -----------------------------------------------------------------------------
    def _ensure_engine(self) -> bool:
        """Restart the engine if it died; True if it did. Raises if no engine can be had."""
        if self.engine.alive():
            return False
        old_url, code = self.engine.url, self.engine.exit_code()
        self.engine.stop(timeout=2)
        try:
            self.engine.start()
            if self.role is Role.TRAIN:  # back to where the old one was: no memory held
                self.engine.release()
        except Exception as e:
            self.engine.stop(timeout=2)  # half started (e.g. the weights failed to load): not usable
            self._engine_retry_at = time.monotonic() + ENGINE_RETRY_S
            self._event("fatal", what="engine", error=f"cannot restart the engine: {e}")
            raise CommandError(f"the engine died and could not be restarted: {e}") from e
        self._event("engine_restarted", engine_url=self.engine.url, engine_pid=self.engine.pid,
                    old_url=old_url, exit_code=code, role=self.role.value,
                    weight_version=self.engine.version)
        return True

    # --- watching and heartbeats ------------------------------------------------------------
    def _watch(self) -> None:
        if self.trainer is not None and not self.trainer.alive():
            self._trainer_died("a trainer process exited")
        if not self.engine.alive() and time.monotonic() >= self._engine_retry_at:
            with contextlib.suppress(CommandError):  # reported as Event fatal; retried later
                self._ensure_engine()

    def _beat(self) -> None:
        if time.monotonic() - self._last_sent < HEARTBEAT_S:
            return
        if self._beat_req is not None and not self._beat_req.Test():
            return  # the head has not taken the last one (busy, or gone): never block on a beat
        info = dict(role=self.role.value, trainer_step=self.trainer.step if self.trainer else None,
                    engine_version=self.engine.version, engine_url=self.engine.url, engine_pid=self.engine.pid,
                    trainer_pid=self.trainer.pid if self.trainer else None)
        self._beat_req = mpi_link.isend_event(self.comm, Event(cell=self.cell, kind="heartbeat", info=info))
        self._last_sent = time.monotonic()

    def _event(self, kind: str, **info) -> None:
        mpi_link.send_event(self.comm, Event(cell=self.cell, kind=kind, info=info))
        self._last_sent = time.monotonic()

