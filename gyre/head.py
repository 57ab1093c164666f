"""The head (MPI rank 0): start-up, and the loop that connects the coordinator core, the policy
and the services.

The bookkeeping of groups and steps (states, admission under the staleness rule, replacement of
dropped groups, bursts, step completion, the `ClusterState` a policy sees) lives in
`gyre.sched.core.Coordinator`, the object the simulator drives too. The work lives in services
(gyre/services): the rollout service runs executions and records them, the cell fleet talks to
the cell agents, training dispatch turns admitted groups into micro-batches and reduces steps,
and the ledger writes everything down. The head turns what happens into core events and carries
out what the core and the policy answer. One loop, read top to bottom in `Head.tick`:

1. `policy.decide(core.cluster_state(now, cells), now)`;
2. apply its role switches (each a protocol exchange with the cell agent) and start the groups
   the core lets start;
3. hand queued micro-batches to idle train cells (work goes by progress); admission happens as
   groups are evaluated (`_on_admission` materializes what the core assigned);
4. when the core says the step is ready: the cells that took part reduce gradients together,
   take one optimizer step, and at the end of a rollout round (`sched.steps_per_sync` steps)
   rollout cells get the new weights.

Everything that ends is written down (gyre.services.ledger): executions to HDF5 shards, which
execution trained in which step (or why not) to ``ledger.jsonl``, per-step figures to
``steps.jsonl``, and the state needed by ``--resume`` to ``state.json`` (the commit point of a
step: on resume, ledger and step rows past it are rolled back).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import signal
import sys
import time
from pathlib import Path
from typing import Callable

from gyre import faults
from gyre.config import GyreConfig, ResumeMode, default_tiny_dir, initial_model
from gyre.events import (CallRecorded, CellRoleChanged, ExecutionEvaluated, ExecutionStarted, GroupDropped, GroupLag,
                         RunEnded, RunStarted, RunStats, StepEnded, WeightsPushed)
from gyre.harness.datasets import TaskStream
from gyre.harness.execute import check_scorable, load_tasks
from gyre.harness.runner import private_dir
from gyre.harness.sandbox import Environments, SandboxConfig
from gyre.model.identity import model_identity
from gyre.model.tiny import ensure_tiny_model
from gyre.proxy.replay import Replay, replayed_calls
from gyre.report import config_file
from gyre.report.health import Health, Thresholds
from gyre.report.history import whole_run
from gyre.report.outputs import Outputs
from gyre.report.session import session_report
from gyre.sched.cells import Cell
from gyre.sched.core import Admission, Coordinator, GroupRecord, StepResult
from gyre.sched.runspec import RunSpec
from gyre.sched.state import Role
from gyre import validation_rounds
from gyre.services.fleet import CellFleet, WeightPaths
from gyre.services.ledger import Ledger, execution_id
from gyre.services.retention import Retention
from gyre.services.rollout import RecordError, RolloutService, harness_broke, journal_dir
from gyre.services.training import StepReduced, TrainingDispatch
from gyre.train.step_stats import lag0_warning
from gyre.traj.audit import Audit, audit_warning
from gyre.services.validation import ValidationSpec, Validator
from gyre.traj.record import FINISHED, limit_of
from gyre.traj.select import SelectionSpec


class Head:
    def __init__(self, cfg: GyreConfig, link, n_cells: int, *, resume: bool = False, engine_key: str = "",
                 clock: Callable[[], float] = time.time, progress_bar: bool = False):
        """`engine_key`: the job's secret the cells' engines accept (the router sends it)."""
        self.cfg, self.link, self.resume, self.clock = cfg, link, resume, clock
        self.engine_key = engine_key
        self.progress_bar = progress_bar                 # a bar of the step's executions (a terminal)
        self.run_dir = Path(cfg.run.dir)
        self.t0 = clock()
        self.stats = RunStats(self.t0, n_cells)          # every figure of the report, from the events
        self.outputs = Outputs()                         # the metrics sink and the console (opened by run)
        self.health = Health(Thresholds.from_config(cfg))
        self.retention: Retention | None = None  # what of the weights stays on disk (made once paths are known)
        self._signalled = False                          # stopped by SIGINT/SIGTERM (scancel, Ctrl-C)
        self.fleet = CellFleet(link, n_cells, emit=self._emit, clock=clock,
                               on_engine_restarted=lambda cell, old: self._spawn(self._replace_endpoint(cell, old)))
        self.training = TrainingDispatch(cfg, self.fleet, emit=self._emit, clock=clock, spawn=self._spawn,
                                         notice=self._notice)
        self.ledger = Ledger(self.run_dir, cfg.shard_dir(), emit=self._emit, clock=clock)
        self.rollout: RolloutService | None = None       # started by run
        self.core: Coordinator | None = None
        self.spec: RunSpec | None = None                # the run spec the core and the policy come from
        self.policy = None
        self._committed = 0                              # version of the last step written down
        self._first_step = 0                             # the step this session started at (resume)
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._cells_written = 0.0
        self.errors: list[str] = []
        self.failed: str | None = None   # why the run had to stop (a task failed, e.g. a record could not be written)
        self.warnings: list[str] = []     # health warnings (gyre/report/health.py), the first of each kind
        self._failing_steps = 0            # steps in a row past run.warn_harness_failure_rate
        self.events: list[dict] = []      # notices of the head and its services (mismatch, reduce retries)
        self.replays: dict[tuple[str, int], list] = {}  # resume: stopped executions to replay
        self.validation: Validator | None = None  # validation rounds ([validate], gyre/services/validation.py)
        self._start_version = 0

    @property
    def cells(self) -> list[Cell]:
        return self.fleet.cells

    @property
    def version(self) -> int:
        return self.core.version if self.core else 0

    def on_message(self, msg) -> None:
        """Called in the event loop for every message a cell sends."""
        self.fleet.on_message(msg)

    def _emit(self, event) -> dict | None:
        """Tell the run's statistics (and the metrics sink) what happened; see gyre/events.py."""
        row = self.stats.apply(event)
        if isinstance(event, StepEnded):
            self._judge(row)
        self.outputs.on_event(event, self.stats, row)
        return row

    def _judge(self, row: dict) -> None:
        """The step's health warnings, into its row (steps.jsonl, metrics, the console's line)."""
        row["warnings"] = warnings = step_warnings(self.health, row, self.cfg.train.mismatch_warn_k3)
        self._failing_steps = self._failing_steps + 1 if "harness_failures" in warnings else 0
        limit = self.cfg.run.stop_harness_failure_steps
        if limit and self._failing_steps >= limit:
            self.fail(f"{warnings['harness_failures']}; {self._failing_steps} steps in a row "
                      f"(run.stop_harness_failure_steps={limit}): fix harness.command (its stderr is above and "
                      f"in the ledger) and run again")
        for kind, why in warnings.items():
            self._notice("health_warning", {"step": row["step"], "kind": kind, "why": why})
            if not any(w.startswith(f"{kind}: ") for w in self.warnings):
                self.warnings.append(f"{kind}: {why}")

    def _on_signal(self) -> None:
        self._signalled = True
        self._stop.set()

    def _notice(self, kind: str, info: dict) -> None:
        self.events.append({"t": self.clock() - self.t0, "cell": None, "kind": kind, "info": info})

    def _spawn(self, coro, name: str | None = None) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(t)
        t.add_done_callback(self._task_done)
        return t

    def _task_done(self, t: asyncio.Task) -> None:
        """No task's failure goes unseen: it stops the run, which says why (report, stderr, exit code)."""
        self._tasks.discard(t)
        if t.cancelled() or t.exception() is None:
            return
        e = t.exception()
        self.fail(f"{t.get_name()}: {type(e).__name__}: {e}")

    def fail(self, why: str) -> None:
        """Stop the run because of ``why``: what was recorded stays; the command exits non-zero."""
        if self.failed is None:
            self.failed = why
            print(f"gyre run: failed: {why}", file=sys.stderr, flush=True)
        self.errors.append(why)
        self._stop.set()

    # ==== start-up ==============================================================================
    def attach(self, core: Coordinator, tasks, paths: WeightPaths, selection: SelectionSpec,
               rollout: RolloutService | None = None) -> None:
        """Bind what start-up decided: the core, the tasks to cycle through, where weights live,
        the selection spec, and the rollout service (tests attach none and play executions)."""
        self.core, self.training.core = core, core
        # the suite's order cycled; a dataset's seeded shuffle or weighted draw, resumed where it was
        d = self.cfg.dataset
        self.task_cycle = TaskStream(tasks, shuffle=bool(d.path) and d.shuffle, seed=d.seed,
                                     start=core.next_group if d.path else 0)
        self.fleet.paths = paths
        self.retention = Retention.from_config(self.cfg, paths.weights_root, paths.ckpt_root)
        self.training.selection = selection
        self.rollout = rollout
        self._committed = core.version

    def schedule(self, version: int = 0, first_group: int = 0) -> Coordinator:
        """The policy and a coordinator core for this run, from its one run spec (the simulator
        builds its own from the same `RunSpec.from_config`); a resumed run starts at `version`."""
        self.spec = RunSpec.from_config(self.cfg, start_version=version, first_group=first_group)
        self.policy = self.spec.policy()
        return self.spec.coordinator(self.policy)

    async def run(self) -> dict:
        cfg = self.cfg
        core, rollout, version = _open_run(self)
        self._write_state()  # a stop before the first step close still resumes
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal)
        # a cell says hello once its engine answers, which engine.startup_timeout_s bounds (vLLM on
        # a loaded 2-core machine, or a large model, takes minutes): wait at least that long
        await self.fleet.wait_hello(max(300.0, cfg.engine.startup_timeout_s + 60), stop=self._stop,
                                    why_stopped=lambda: "stopped by a signal" if self._signalled else
                                    f"failed: {self.failed}")
        now = self.clock()
        self.t0 = self.fleet.t0 = now
        self._emit(RunStarted(now, len(self.cells)))
        for c in self.cells:  # the role each cell is in at time zero
            self._emit(CellRoleChanged(now, c.id, c.role.value))
        self.outputs.open(cfg, self.run_dir, version, len(self.cells), self.progress_bar)
        roles = self.policy.initial_roles(len(self.cells))
        for cell in self.cells:
            cell.since, cell.last_seen = now, now
        await rollout.start([c.engine_url for c, r in zip(self.cells, roles) if r is Role.ROLLOUT],
                            engine_key=self.engine_key, wait_for_endpoint_s=120.0)
        # cells boot as rollout; the policy's initial train cells switch once, before any work
        await asyncio.gather(*(self._to_train(c) for c, r in zip(self.cells, roles) if r is Role.TRAIN))
        if core.rollout_version > 0:
            await asyncio.gather(*(self.fleet.push(c, core.rollout_version) for c in self.fleet.in_role(Role.ROLLOUT)))
        stopped = False
        try:
            while not core.done:
                if self._stop.is_set() or rollout.broken:  # broken: harnesses cannot start in their sandbox
                    stopped = True
                    break
                await self.tick(self.clock())
                await asyncio.sleep(0.1)
            if not stopped and self.validation is not None:
                await validation_rounds.final(self)
        finally:
            await rollout.stop_harnesses()
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
            try:
                rollout.compact()  # the per-execution shards, merged
            except RecordError as e:
                self.fail(str(e))
            broke = self.failed or rollout.broken
            why = f"run stopped: {broke}" if broke else "run stopped" if stopped else "run ended"
            self.ledger.close_unfinished(core.unfinished(), why, core.step.index)
            if stopped:
                self._write_state()  # the groups started since the last step close are counted: ids never reused
            await rollout.close()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        t1 = self.clock()
        self._emit(RunEnded(t1, stopped))
        why = f"{rollout.broken}" if rollout.broken else "; ".join(self.errors) if stopped and self.errors else None
        self.outputs.close(self._committed, t1 - self.t0, cancelled=stopped and self._signalled, why=why,
                           run_dir=self.run_dir)
        await asyncio.gather(*(self.fleet.stop(c) for c in self.cells))
        self.ledger.close()
        return self.report(t1, stopped)

    # ==== one tick ==============================================================================
    async def tick(self, now: float) -> None:
        for c in self.fleet.check_heartbeats(now, self.cfg.run.heartbeat_timeout_s):
            self._spawn(self.rollout.remove_endpoint(c.engine_url))
        if now - self._cells_written > 0.5:
            self._cells_written = now
            self.fleet.write_status(self.run_dir / "cells.json", now, self.t0, self.version, len(self.core.step.queue))
        state = self.core.cluster_state(now, tuple(c.view() for c in self.cells))
        if self.validation is not None and self.validation.running:  # rollout work the core does not own
            state = dataclasses.replace(state, running=(*state.running, *self.validation.views()))
        decision = self.policy.decide(state, now)
        for sw in decision.switches:
            cell = self.cells[sw.cell]
            if sw.to is Role.TRAIN and cell.role is Role.ROLLOUT:
                self.fleet.set_role(cell, Role.TO_TRAIN, now)
                self._spawn(self._to_train(cell))
            elif sw.to is Role.ROLLOUT and cell.role is Role.TRAIN:
                self.fleet.set_role(cell, Role.TO_ROLLOUT, now)
                self._spawn(self._to_rollout(cell))
        self.start_groups(decision.start_groups, now)
        validation_rounds.if_due(self)
        self.training.dispatch()
        if self.core.step_ready() and all(c.role.settled or c.role is Role.FAILED for c in self.cells):
            # (a cell mid-switch would miss the step: wait until it lands)
            self.core.step_ending(now)
            self._spawn(self._finish_step())

    # ==== switches: the fleet's commands, the rollout service's endpoints =======================
    async def _to_train(self, cell: Cell) -> None:
        t = self.clock()
        self.fleet.set_role(cell, Role.TO_TRAIN, t)
        await self.rollout.remove_endpoint(cell.engine_url)  # aborted calls retry elsewhere
        rep = await self.fleet.to_train(cell, self.core.version, self.core.step.update)
        cell.switch_phases.append({"to": "train", "ok": rep.ok, "wall_s": self.clock() - t, **rep.phases})
        if rep.ok:
            self.fleet.set_role(cell, Role.TRAIN, self.clock())
        else:
            self.fleet.fail(cell, f"cell {cell.id} to_train failed: {rep.error}")

    async def _to_rollout(self, cell: Cell) -> None:
        t = self.clock()
        version = self.core.rollout_version  # the round's weights, not the newest optimizer step's
        rep = await self.fleet.to_rollout(cell, version)
        cell.switch_phases.append({"to": "rollout", "ok": rep.ok, "wall_s": self.clock() - t, **rep.phases})
        if not rep.ok:
            self.fleet.fail(cell, f"cell {cell.id} to_rollout failed: {rep.error}")
            return
        if self.core.rollout_version != version:  # weights were pushed while it switched
            await self.fleet.push(cell, self.core.rollout_version)
        self.rollout.add_endpoint(cell.engine_url)
        self.fleet.set_role(cell, Role.ROLLOUT, self.clock())

    async def _replace_endpoint(self, cell: Cell, old: str) -> None:
        await self.rollout.remove_endpoint(old)
        if cell.role is Role.ROLLOUT:
            await self.fleet.push(cell, self.core.rollout_version)
            self.rollout.add_endpoint(cell.engine_url)

    # ==== executions ============================================================================
    # The head's public seam: the sync handlers below (start_groups, execution_scored,
    # execution_recorded, step_ended, step_committed) are its whole translation of what happened
    # into core events, ledger lines and step rows; the async code around them is messaging and
    # I/O. The loop calls them as things happen; a replay (tests/sched/test_coordinator_core.py
    # replays a simulator trace, benchmarks/head_memory.py a long run) calls them in the same order.
    def start_groups(self, n: int, now: float) -> list[GroupRecord]:
        started = self.core.start_groups(n, now)
        for g in started:
            task = next(self.task_cycle)
            self.ledger.group_started(g.id, task.name)
            for k in range(self.cfg.harness.group_size):
                eid = execution_id(g.id, task.name, k)
                self.core.execution_started(g.id, eid, now)
                replays = self.replays.get((task.name, k))
                self._emit(ExecutionStarted(now, eid, g.id, task.name))
                self._spawn(self._execution(g.id, task, eid, replays.pop(0) if replays else None),
                            name=f"execution {eid}")
        if started:  # ids are never reused, even after a hard stop
            self._write_state()
        return started

    async def _execution(self, gid: int, task, eid: str, replay=None) -> None:
        if replay:
            self.ledger.resuming(eid, replay[0])
        rec = await self.rollout.execute(task, eid, gid, replay=replay[1] if replay else None,
                                         on_ended=lambda _status: self.core.execution_ended(eid, self.clock()),
                                         on_scored=lambda r: self.execution_scored(eid, r, self.clock()))
        self.execution_recorded(eid, rec, self.clock())
        if replay:  # replay-resume: which stopped execution this one continued, and what it saved
            source = replay[1]
            recorded = source.recorded if isinstance(source, Replay) else len(source.calls)
            self.ledger.resumed(eid, replay[0], recorded, replayed_calls(rec.tree))
            if self.rollout.proxy is not None and self.rollout.proxy.journal is not None:
                self.rollout.proxy.journal.discard(replay[0])  # a killed run's journal: taken over

    def execution_scored(self, eid: str, rec, now: float) -> None:
        """An execution ended, was scored and is on disk (its own small shard, compacted at the end):
        written down and told, before the core hears of it (the rollout service's `settle`)."""
        reward, usable = _reward_of(rec)
        self.ledger.execution_ended(eid, reward, "" if usable else harness_broke(rec) or rec.reward_source
                                    or f"status {rec.status}",
                                    unscorable=rec.reward_source, error=rec.error)
        url_cell = {u: c.id for c in self.cells for u in self.fleet.urls_of(c) if u}
        for call in rec.tree.calls:
            self._emit(CallRecorded(call.t_start, call.t_end, url_cell.get(call.endpoint), eid, call.n_input, call.n_output))
        self._emit(ExecutionEvaluated(now, eid, rec.group, rec.status, reward, rec.min_version,
                                      float(rec.tree.stats().unique_tokens), usable, limit_of(rec.error)))

    def execution_recorded(self, eid: str, rec, now: float) -> None:
        """Its record is on disk and written down: only now does the core hear of it, so a SIGKILL
        from here on loses none of it."""
        reward, usable = _reward_of(rec)
        self.training.hold(rec)
        adm = self.core.execution_evaluated(eid, now, version=rec.min_version, tokens=float(rec.tree.stats().unique_tokens),
                                            usable=usable, reward=reward if usable else None)
        self._on_admission(adm)

    def _on_admission(self, adm: Admission) -> None:
        """Record dropped groups; materialize the groups the core assigned to the open step."""
        for g in adm.dropped:
            self._emit(GroupDropped(self.clock(), g.id, g.reason))
            for eid in g.executions:
                self.ledger.line(eid, g, admitted=False, reason=g.reason)
        for g in adm.assigned:
            self.training.materialize(g, self.ledger)
        for g in adm.dropped + adm.assigned:  # their records are needed no more: they are on disk
            self.training.release(g.executions)

    # ==== steps =================================================================================
    async def _finish_step(self) -> None:
        index = self.core.step.index
        ended = False
        try:
            red = await self.training.reduce(index)
            if isinstance(red, str):  # replicas may now disagree: stop rather than train on
                self.errors.append(red)
                self._stop.set()
                return
            if red is None:  # lost gradients are recomputed, or no trainer yet: the next tick retries
                return
            if not red.final:  # an update inside the step (train.minibatches_per_step): the next part trains
                self.training.update_applied(red)
                return
            res = self.step_ended(self.clock())
            ended = True
            push_s = 0.0
            if res.push_due:  # end of a rollout round: rollout cells get the new weights
                t = self.clock()
                await asyncio.gather(*(self.fleet.push(c, res.version) for c in self.fleet.in_role(Role.ROLLOUT)))
                push_s = self.clock() - t
                self._emit(WeightsPushed(t, t + push_s, res.version))  # the rollout cells' pause
            self.step_committed(res, red, push_s)
        finally:
            if not ended:
                self.core.step_aborted()

    def step_ended(self, now: float) -> StepResult:
        """The optimizer step was applied on every participant: the version moves on."""
        faults.hit("head", "step_end")
        return self.core.step_ended(now)

    def step_committed(self, res: StepResult, red: StepReduced, push_s: float) -> None:
        """(Weights pushed if the round ended) the step is written down; the next one fills."""
        if res.push_due:
            self.core.weights_pushed(res.version)
        self._close_step(res, red, push_s)
        self._on_admission(res.admission)

    def _close_step(self, res: StepResult, red: StepReduced, push_s: float) -> None:
        """Step rows and ledger lines, then state.json: the commit point of the step."""
        for g in res.groups:  # written only now: admitted means trained in this step
            for eid, stal in self.training.admitted.pop(g.id, []):
                self.ledger.line(eid, g, admitted=True, staleness=stal, step=res.index)
        extra, _, _ = self.training.step_figures(self.stats.microbatch_stats(res.microbatches),
                                                 res.replaced, len(res.groups), res.microbatches, res.index)
        norms = red.grad_norms or [red.grad_norm]  # one per optimizer update of the step
        extra.update(minibatches=len(norms), minibatch_grad_norms=norms)
        row = self._emit(StepEnded(
            res.started_at or res.ended_at, res.ended_at, res.index, res.version,
            tuple(GroupLag(g.id, g.version, g.lag_steps, g.lag_syncs, g.train_tokens) for g in res.groups),
            tuple(res.microbatches), tuple(c.id for c in red.participants), res.push_due, red.seconds, push_s,
            red.grad_norm, extra))
        self.ledger.step_row(row)
        self._committed = res.version
        self.training.step_closed(res.microbatches)
        self._write_state()
        self._spawn(self._retain(row, res.version))  # state.json now points at this version: older ones may go

    async def _retain(self, row: dict, committed: int) -> None:
        """Exports and checkpoints no engine, resume or retention rule needs go (gyre/services/retention.py)."""
        why = await asyncio.to_thread(self.retention.after_step, row, committed, self.core.rollout_version)
        if why:
            self._notice("disk_budget", {"step": row["step"], "why": why})
            self.warnings.append(f"disk_budget: {why}")

    # ==== state =================================================================================
    def _write_state(self) -> None:
        # shards are durable as each execution ends, so state never points past what is on disk;
        # the version is the last *committed* step: a step that ended but is not yet written down (its weights
        # still being pushed) is redone after a hard stop, never counted as trained unrecorded
        v, paths = self._committed, self.fleet.paths
        self.ledger.write_state(version=v, rollout_version=self.core.rollout_version,
                                groups_started=self.core.next_group, weights=paths.weights(v),
                                checkpoint=paths.checkpoint(v))

    # ==== report ================================================================================
    def report(self, t1: float, stopped: bool) -> dict:
        """report.json: the whole run's (gyre/report/history.py), this session's folded into it."""
        return whole_run(self.run_dir, session_report(self, t1, stopped), self._first_step)


def _open_run(head: Head) -> tuple[Coordinator, RolloutService, int]:
    """Start-up of `Head.run`: the model, tasks and sandboxes checked, the rollout service, the
    ledger (a resumed run's state and replays), the core, the weights' places, validation."""
    cfg = head.cfg
    private_dir(head.run_dir)
    model_dir = Path(initial_model(cfg) or ensure_tiny_model(default_tiny_dir(cfg), cfg.model.tiny_family))
    tasks = load_tasks(cfg)  # harness.suite, strict_suite, image_template, tasks
    envs = Environments(SandboxConfig.from_config(cfg.harness))  # one placement per task, shared
    check_scorable(tasks, envs, cfg.harness.min_scorable_share)  # refused before any work
    rollout = RolloutService(cfg, envs, model_dir, model_identity(model_dir), private_dir(cfg.shard_dir()),
                             fault_scope="head")
    if head.resume:
        rollout.compact()  # finish one a crash cut short
    version, first_group = head.ledger.load_state() if head.resume else (0, 0)
    head._first_step = version
    head.replays = (head.ledger.stopped_to_replay(journal_dir(cfg))
                    if head.resume and cfg.harness.resume is ResumeMode.REPLAY else {})
    head.ledger.open()
    config_file.write(cfg, head.run_dir)  # what `--resume` and `gyre config show --run` read back
    core = head.schedule(version, first_group)
    paths = WeightPaths(model_dir, Path(cfg.train.export_dir or head.run_dir / "weights"),
                        Path(cfg.train.checkpoint_dir or head.run_dir / "checkpoints"))
    head.attach(core, tasks, paths, SelectionSpec.from_config(cfg.selection), rollout)
    if head.resume:
        head.ledger.resume_marker(version)
    head._start_version = version
    if cfg.validate.every_steps > 0:  # held-out rounds through the same rollout service, never trained
        head.validation = Validator(ValidationSpec.from_config(cfg), rollout, head.run_dir,
                                    identity=model_identity(model_dir), clock=head.clock)
    return core, rollout, version


def step_warnings(health: Health, row: dict, mismatch_warn_k3: float) -> dict[str, str]:
    """Every warning a step row raises: the health checks, the lag-0 train/inference mismatch and
    the token-identity audit (trained tokens that differ from what the engine returned)."""
    warnings = health.check(row)
    mismatch = lag0_warning(row, mismatch_warn_k3)
    if mismatch:
        warnings["mismatch_lag0"] = mismatch
    audit = audit_warning(Audit(row.get("audit_tokens") or 0, row.get("audit_mismatched_tokens") or 0,
                                row.get("audit_unchecked_tokens") or 0, row.get("audit_first_offender")))
    if audit:
        warnings["token_audit"] = audit
    return warnings


def _reward_of(rec) -> tuple[float | None, bool]:
    """(reward, whether it can train): a finished execution with a finite reward whose harness did
    not break (a crash's 0 is the harness's bug: never trained, gyre.services.rollout.harness_broke)."""
    reward = rec.reward if math.isfinite(rec.reward) else None
    return reward, rec.status in FINISHED and reward is not None and not harness_broke(rec)
