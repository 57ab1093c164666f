"""The head (MPI rank 0): start-up, messaging and I/O around the coordinator core.

The bookkeeping of groups and steps (states, admission under the staleness rule, replacement of
dropped groups, bursts, step completion, the `ClusterState` a policy sees) lives in
`gyre.sched.core.Coordinator`, the object the simulator drives too. The head turns what happens
(harness processes ending, evaluations, replies of cell agents) into core events and carries out
what the core and the policy answer. One loop, read top to bottom in `Head.tick`:

1. `policy.decide(core.cluster_state(now, cells), now)`;
2. apply its role switches (each a protocol exchange with the cell agent) and start the groups
   the core lets start;
3. hand queued micro-batches to idle train cells (work goes by progress); admission happens as
   groups are evaluated (`_on_admission` materializes what the core assigned);
4. when the core says the step is ready: the cells that took part reduce gradients together,
   take one optimizer step, and at the end of a rollout round (`sched.steps_per_sync` steps)
   rollout cells get the new weights.

Everything that ends is written down: executions to HDF5 shards, which execution trained in
which step (or why not) to ``ledger.jsonl``, per-step figures to ``steps.jsonl``, and the state
needed by ``--resume`` to ``state.json`` (the commit point of a step: on resume, ledger and step
rows past it are rolled back, see `_reconcile`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import re
import secrets
import signal
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

from gyre import faults
from gyre.config import GyreConfig, default_tiny_dir
from gyre.events import (CallRecorded, CellRoleChanged, ExecutionDropped, ExecutionEvaluated, ExecutionStarted,
                         GroupDropped, GroupLag, MicroBatchDone, RunEnded, RunStarted, RunStats, StepEnded)
from gyre.fsio import atomic_write_json, atomic_write_text
from gyre.harness.execute import FINISHED, run_and_evaluate
from gyre.proxy.replay import REPLAY_ENDPOINT
from gyre.report.metrics import MetricsSink
from gyre.sched.cells import Cell
from gyre.sched.core import Admission, Coordinator, CoreSpec, GroupRecord, StepResult
from gyre.sched.protocol import (Command, Event, PrepareReduce, PushWeights, Reduce, Reply, Stop, ToRollout, ToTrain,
                                 Train, reply_for)
from gyre.sched.state import Role
from gyre.train.step_stats import lag0_warning, merge, summarize


_EXECUTION_ID = re.compile(r"^q(?P<group>\d+)-(?P<task>.+)-g(?P<member>\d+)$")  # as _start_group names them


class Head:
    def __init__(self, cfg: GyreConfig, link, n_cells: int, *, resume: bool = False):
        self.cfg, self.link, self.resume = cfg, link, resume
        self.run_dir = Path(cfg.run.dir)
        self.cells = [Cell(i, i + 1) for i in range(n_cells)]
        self.core: Coordinator | None = None
        self._committed = 0                              # version of the last step written down
        self.mb_ids = itertools.count()
        # payload of the open step (the core keeps which micro-batch is where)
        self.batches: dict[int, dict] = {}              # micro-batch id -> wire dict
        self.admitted: dict[int, list] = {}             # group id -> [(execution id, staleness)]
        self.task_of: dict[int, object] = {}            # group id -> task
        # an ended execution's full record (tree included) stays only until its shard is on disk
        # and its group was materialized or dropped (`_release`); what the ledger still needs
        # after that is its summary: execution id -> (reward or None, why it cannot train or "")
        self.records: dict[str, object] = {}            # execution id -> ExecutionRecord
        self.ended: dict[str, tuple[float | None, str]] = {}
        self._unwritten: set[str] = set()               # ids in records_buffer
        self._to_materialize: set[int] = set()          # groups with records, not yet materialized or dropped
        self._futures: dict[int, asyncio.Future] = {}
        self._locks = [asyncio.Lock() for _ in range(n_cells)]
        self._hello = asyncio.Event()
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self.t0 = time.time()
        self.records_buffer: list = []
        self.errors: list[str] = []
        self.warnings: list[str] = []     # e.g. train/inference mismatch at lag 0 (once per kind)
        self.events: list[dict] = []      # restarts and failures, for the report
        self.cell_info: dict[int, dict] = {}
        self._cells_written = 0.0
        self.replays: dict[tuple[str, int], list] = {}  # resume: stopped executions to replay
        self.unscorable: dict[str, int] = {}  # executions that ended with no reward, by why
        self.stats = RunStats(self.t0, n_cells)         # every figure of the report, from the events
        self.metrics = None                              # the metrics sink (opened by run)
        self.pool = None                                 # the harness pool (started by run)

    @property
    def version(self) -> int:
        return self.core.version if self.core else 0

    def _emit(self, event) -> dict | None:
        """Tell the run's statistics (and the metrics sink) what happened; see gyre/events.py."""
        row = self.stats.apply(event)
        if self.metrics is not None:
            self.metrics.on_event(event, self.stats, row)
        return row

    def _set_role(self, cell: Cell, role: Role, now: float) -> None:
        if role is not cell.role:
            self._emit(CellRoleChanged(now, cell.id, role.value))
        cell.set_role(role, now)

    # ==== messaging (head <-> cell agents) ======================================================
    # The only place that builds Commands and reads Replies/Events: a change of the protocol's
    # types lands here and nowhere else.
    def on_message(self, msg) -> None:
        """Called in the event loop for every message a cell sends."""
        now = time.time()
        if isinstance(msg, Reply):
            self.cells[msg.cell].last_seen = now
            fut = self._futures.pop(msg.seq, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, Event):
            cell = self.cells[msg.cell]
            cell.last_seen = now
            self.cell_info[cell.id] = {**self.cell_info.get(cell.id, {}), **msg.info}
            if msg.kind not in ("heartbeat", "hello"):
                self.events.append({"t": now - self.t0, "cell": cell.id, "kind": msg.kind, "info": msg.info})
            if msg.kind == "hello":
                cell.engine_url, cell.hostname = msg.info["engine_url"], msg.info.get("hostname", "")
                cell.since = now
                if all(c.engine_url for c in self.cells):
                    self._hello.set()
            elif msg.kind == "engine_restarted":
                old, cell.engine_url = cell.engine_url, msg.info["engine_url"]
                cell.old_urls.append(old)
                self._spawn(self._replace_endpoint(cell, old))
            elif msg.kind == "fatal":
                self.errors.append(f"cell {cell.id}: {msg.info}")
                self._set_role(cell, Role.FAILED, now)

    async def _call(self, cell: Cell, cmd: Command, timeout: float = 600.0) -> Reply:
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

    def _cmd_to_train(self, cell: Cell, version: int):
        return self._call(cell, ToTrain(version=version, checkpoint=self.checkpoint_path(version) or None))

    def _cmd_to_rollout(self, cell: Cell, version: int):
        return self._call(cell, ToRollout(version=version, weights=self.weights_path(version)))

    def _cmd_push(self, cell: Cell, version: int):
        return self._call(cell, PushWeights(version=version, weights=self.weights_path(version)))

    def _cmd_train(self, cell: Cell, step: int, mid: int):
        return self._call(cell, Train(step=step, mb_id=mid, batch=self.batches[mid]))

    def _cmd_prepare_reduce(self, cell: Cell, step: int):
        return self._call(cell, PrepareReduce(step=step))

    def _cmd_reduce(self, cell: Cell, step: int, participants: list[Cell], leader: Cell, new: int):
        return self._call(cell, Reduce(
            step=step, participants=[c.id for c in participants], leader=leader.id,
            weights_dir=str(self.weights_root / f"v{new}"), checkpoint_dir=str(self.ckpt_root / f"v{new}")))

    def _cmd_stop(self, cell: Cell):
        return self._call(cell, Stop(), timeout=60)

    # ==== paths =================================================================================
    def weights_path(self, version: int) -> str:
        return str(self.model_dir) if version == 0 else str(self.weights_root / f"v{version}")

    def checkpoint_path(self, version: int) -> str:
        return "" if version == 0 else str(self.ckpt_root / f"v{version}")

    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    # ==== the run ===============================================================================
    async def run(self) -> dict:
        from gyre.engine.router import Router
        from gyre.harness.evaluator import EvaluatorPool
        from gyre.harness.execute import check_scorable, load_tasks
        from gyre.harness.runner import HarnessPool, private_dir
        from gyre.harness.sandbox import Environments, SandboxConfig
        from gyre.model.identity import model_identity
        from gyre.model.tiny import ensure_tiny_model
        from gyre.model.tokenizer import load_tokenizer
        from gyre.proxy.server import Proxy, create_app, proxy_options, start_site
        from gyre.sched import policy_from_config
        from gyre.traj.select import SelectionSpec
        from gyre.traj.store import ShardWriter, compact, shard_identity

        cfg = self.cfg
        private_dir(self.run_dir)
        self.model_dir = Path(cfg.model.path or ensure_tiny_model(default_tiny_dir(cfg), cfg.model.tiny_family))
        self.weights_root = Path(cfg.train.export_dir or self.run_dir / "weights")
        self.ckpt_root = Path(cfg.train.checkpoint_dir or self.run_dir / "checkpoints")
        self.policy = policy_from_config(cfg)
        self.spec = SelectionSpec.from_config(cfg.selection)
        self.tasks = load_tasks(cfg)  # harness.suite, strict_suite, image_template, tasks
        envs = Environments(SandboxConfig.from_config(cfg.harness))  # one placement per task, shared
        check_scorable(self.tasks, envs, cfg.harness.min_scorable_share)  # refused before any work
        self.task_cycle = itertools.cycle(self.tasks)
        identity = model_identity(self.model_dir)
        self.writer = ShardWriter.from_config(cfg.store, private_dir(cfg.shard_dir()), shard_identity(identity))
        if self.resume:
            compact(self.writer, cfg.store.executions_per_shard)  # finish one a crash cut short
        version, first_group = self._load_state() if self.resume else (0, 0)
        self.replays = self._stopped_to_replay() if self.resume and cfg.harness.resume == "replay" else {}
        self.ledger = open(self.run_dir / "ledger.jsonl", "a", buffering=1)
        self.steps_file = open(self.run_dir / "steps.jsonl", "a", buffering=1)
        s = cfg.sched
        self.core = Coordinator(CoreSpec(
            steps=cfg.run.steps, groups_per_step=cfg.run.groups_per_step, group_size=cfg.harness.group_size,
            staleness=s.staleness, staleness_rule=s.staleness_rule, steps_per_sync=s.steps_per_sync,
            start_version=version, first_group=first_group,
            # equal rewards carry no signal only for a baseline-relative advantage
            skip_zero_variance=s.skip_zero_variance and cfg.train.advantage != "reward",
            max_replacements_per_step=s.max_replacements_per_step, burst_order=cfg.train.burst_order,
            seed=cfg.run.seed), self.policy.admission_key)
        self._committed = version
        if self.resume:
            self.ledger.write(json.dumps({"resume": True, "version": version, "at": time.time()}) + "\n")
        self._save_state()  # a stop before the first step close still resumes
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stop.set)
        try:
            await asyncio.wait_for(self._hello.wait(), 300)
        except asyncio.TimeoutError:
            raise RuntimeError("cells did not say hello within 300 s: " +
                               ", ".join(f"cell {c.id}" for c in self.cells if not c.engine_url))
        now = time.time()
        self.t0 = now
        self._emit(RunStarted(now, len(self.cells)))
        for c in self.cells:  # the role each cell is in at time zero
            self._emit(CellRoleChanged(now, c.id, c.role.value))
        self.metrics = MetricsSink(self.run_dir, cfg.run.loggers, name=cfg.run.name, config=asdict(cfg),
                                   wandb_mode=cfg.run.wandb_mode)
        roles = self.policy.initial_roles(len(self.cells))
        self.router = Router([], api_key=self.link.engine_key, timeout_s=cfg.engine.request_timeout_s,
                             wait_for_endpoint_s=120.0)
        for cell, role in zip(self.cells, roles):
            cell.since, cell.last_seen = now, now
            if role is Role.ROLLOUT:
                self.router.add_endpoint(cell.engine_url)
        # cells boot as rollout; the policy's initial train cells switch once, before any work
        await asyncio.gather(*(self._to_train(c) for c, r in zip(self.cells, roles) if r is Role.TRAIN))
        if self.core.rollout_version > 0:
            await asyncio.gather(*(self._cmd_push(c, self.core.rollout_version)
                                   for c in self.cells if c.role is Role.ROLLOUT))
        self.proxy = Proxy(self.router, load_tokenizer(self.model_dir), identity=identity,
                           default_max_tokens=cfg.proxy.default_max_tokens, max_tokens_cap=cfg.proxy.max_tokens_cap,
                           max_executions=cfg.proxy.max_executions, **proxy_options(cfg.proxy, self.model_dir))
        runner, port = await start_site(create_app(self.proxy, admin_key=secrets.token_urlsafe(24),
                                                   max_body_bytes=cfg.proxy.max_body_bytes), cfg.proxy.host, cfg.proxy.port)
        self.base_url = f"http://{cfg.proxy.host}:{port}/v1"
        self.pool = HarnessPool.from_config(cfg, envs)
        self.evaluators = EvaluatorPool.from_config(cfg, envs)
        stopped = False
        try:
            while not self.core.done:
                if self._stop.is_set() or self.pool.broken:  # broken: harnesses cannot start in their sandbox
                    stopped = True
                    break
                await self.tick(time.time())
                await asyncio.sleep(0.1)
        finally:
            await self.pool.stop_all()
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
            self._flush(force=True)
            compact(self.writer, cfg.store.executions_per_shard)  # the per-execution shards, merged
            self._close_ledger(f"run stopped: {self.pool.broken}" if self.pool.broken
                               else "run stopped" if stopped else "run ended")
            if self.pool.broken:
                print(f"gyre run: stopped: {self.pool.broken}", file=sys.stderr, flush=True)
            if stopped:
                self._save_state()  # the groups started since the last step close are counted: ids never reused
            self.evaluators.shutdown(wait=True)
            await runner.cleanup()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        t1 = time.time()
        for c in self.cells:
            c.close(t1)
        self._emit(RunEnded(t1, stopped))
        self.metrics.close()
        await asyncio.gather(*(self._cmd_stop(c) for c in self.cells))
        await self.router.close()
        self.ledger.close()
        self.steps_file.close()
        return self.report(t1, stopped)

    # ==== one tick ==============================================================================
    async def tick(self, now: float) -> None:
        self._check_heartbeats(now)
        if now - self._cells_written > 0.5:
            self._write_cells(now)
        decision = self.policy.decide(self.core.cluster_state(now, tuple(c.view() for c in self.cells)), now)
        for sw in decision.switches:
            cell = self.cells[sw.cell]
            if sw.to is Role.TRAIN and cell.role is Role.ROLLOUT:
                self._set_role(cell, Role.TO_TRAIN, now)
                self._spawn(self._to_train(cell))
            elif sw.to is Role.ROLLOUT and cell.role is Role.TRAIN:
                self._set_role(cell, Role.TO_ROLLOUT, now)
                self._spawn(self._to_rollout(cell))
        self._start_groups(decision.start_groups, now)
        self._dispatch()
        if self.core.step_ready() and all(c.role.settled or c.role is Role.FAILED for c in self.cells):
            # (a cell mid-switch would miss the step: wait until it lands)
            self.core.step_ending(now)
            self._spawn(self._finish_step())

    def _check_heartbeats(self, now: float) -> None:
        limit = self.cfg.run.heartbeat_timeout_s
        for c in self.cells:
            if c.role is not Role.FAILED and now - c.last_seen > limit:
                self.errors.append(f"cell {c.id} silent for {now - c.last_seen:.0f} s: marked failed")
                self._set_role(c, Role.FAILED, now)
                self._spawn(self.router.remove_endpoint(c.engine_url, abort=True))

    # ==== switches ==============================================================================
    async def _to_train(self, cell: Cell) -> None:
        t = time.time()
        self._set_role(cell, Role.TO_TRAIN, t)
        await self.router.remove_endpoint(cell.engine_url, abort=True)  # aborted calls retry elsewhere
        rep = await self._cmd_to_train(cell, self.core.version)
        cell.switch_phases.append({"to": "train", "ok": rep.ok, "wall_s": time.time() - t, **rep.phases})
        if rep.ok:
            self._set_role(cell, Role.TRAIN, time.time())
        else:
            self.errors.append(f"cell {cell.id} to_train failed: {rep.error}")
            self._set_role(cell, Role.FAILED, time.time())

    async def _to_rollout(self, cell: Cell) -> None:
        t = time.time()
        version = self.core.rollout_version  # the round's weights, not the newest optimizer step's
        rep = await self._cmd_to_rollout(cell, version)
        cell.switch_phases.append({"to": "rollout", "ok": rep.ok, "wall_s": time.time() - t, **rep.phases})
        if not rep.ok:
            self.errors.append(f"cell {cell.id} to_rollout failed: {rep.error}")
            self._set_role(cell, Role.FAILED, time.time())
            return
        if self.core.rollout_version != version:  # weights were pushed while it switched
            await self._cmd_push(cell, self.core.rollout_version)
        self.router.add_endpoint(cell.engine_url)
        self._set_role(cell, Role.ROLLOUT, time.time())

    async def _replace_endpoint(self, cell: Cell, old: str) -> None:
        await self.router.remove_endpoint(old, abort=True)
        if cell.role is Role.ROLLOUT:
            await self._cmd_push(cell, self.core.rollout_version)
            self.router.add_endpoint(cell.engine_url)

    # ==== executions ============================================================================
    # The sync handlers below (_start_groups, _execution_done, _step_ended, _step_committed) are
    # the head's whole translation of what happened into core events; the async code around them
    # is messaging and I/O. tests/test_coordinator_core.py replays a simulator trace through them.
    def _start_groups(self, n: int, now: float) -> list[GroupRecord]:
        started = self.core.start_groups(n, now)
        for g in started:
            self._start_group(g, now)
        if started:  # ids are never reused, even after a hard stop
            self._write_state()
        return started

    def _start_group(self, g: GroupRecord, now: float) -> None:
        task = self.task_of[g.id] = next(self.task_cycle)
        for k in range(self.cfg.harness.group_size):
            eid = f"q{g.id}-{task.name}-g{k}"
            self.core.execution_started(g.id, eid, now)
            replays = self.replays.get((task.name, k))
            self._emit(ExecutionStarted(now, eid, g.id))
            self._spawn(self._execution(g.id, task, eid, replays.pop(0) if replays else None))

    async def _execution(self, gid: int, task, eid: str, replay=None) -> None:
        if replay:  # written first: a stopped execution's recording is never replayed into two executions
            self.ledger.write(json.dumps({"resuming": eid, "from": replay[0]}) + "\n")
        rec = await run_and_evaluate(self.proxy, self.pool, self.evaluators, task, eid, gid, self.base_url,
                                     on_ended=lambda _status: self.core.execution_ended(eid, time.time()),
                                     replay=replay[1] if replay else None,
                                     infra_retries=self.cfg.harness.infra_retries)
        self._execution_done(eid, rec, time.time())
        if replay:  # replay-resume: which stopped execution this one continued, and what it saved
            self.ledger.write(json.dumps({
                "resumed": eid, "from": replay[0], "recorded_calls": len(replay[1].calls),
                "replayed_calls": sum(c.endpoint == REPLAY_ENDPOINT for c in rec.tree.calls)}) + "\n")

    def _execution_done(self, eid: str, rec, now: float) -> None:
        """An execution ended and was scored: its record is on disk (its own small shard, compacted
        at the end) before the core hears of it, so a SIGKILL from here on loses none of it."""
        faults.hit("head", "execution_ended")
        self.records[eid] = rec
        self._to_materialize.add(rec.group)
        usable = rec.status in FINISHED and math.isfinite(rec.reward)
        reward = rec.reward if math.isfinite(rec.reward) else None
        self.ended[eid] = (reward, "" if usable else rec.reward_source or f"status {rec.status}")
        if reward is None:
            why = rec.reward_source or "no reward"
            self.unscorable[why] = self.unscorable.get(why, 0) + 1
        url_cell = {u: c.id for c in self.cells for u in self._urls_of(c) if u}
        for call in rec.tree.calls:
            self._emit(CallRecorded(call.t_start, call.t_end, url_cell.get(call.endpoint), eid))
        tokens = float(rec.tree.stats().unique_tokens)
        self._emit(ExecutionEvaluated(now, eid, rec.group, rec.status, reward, rec.min_version, tokens, usable))
        self.records_buffer.append(rec)
        self._unwritten.add(eid)
        self._flush()  # durable before the coordinator hears of it
        faults.hit("head", "execution_recorded")
        adm = self.core.execution_evaluated(eid, now, version=rec.min_version, tokens=tokens, usable=usable,
                                            reward=reward if usable else None)
        self._on_admission(adm)

    def _on_admission(self, adm: Admission) -> None:
        """Record dropped groups; materialize the groups the core assigned to the open step."""
        for g in adm.dropped:
            self._emit(GroupDropped(time.time(), g.id, g.reason))
            for eid in g.executions:
                self._ledger(eid, g, admitted=False, reason=g.reason)
        for g in adm.assigned:
            self._materialize(g)
        for g in adm.dropped + adm.assigned:  # their records are needed no more once on disk
            self._to_materialize.discard(g.id)
            self._release(g.executions)

    def _release(self, eids) -> None:
        """Free the full records whose shard is durable and whose group was materialized or dropped."""
        for eid in eids:
            rec = self.records.get(eid)
            if rec is not None and eid not in self._unwritten and rec.group not in self._to_materialize:
                del self.records[eid]

    def _materialize(self, g: GroupRecord) -> None:
        from gyre.batch import to_wire
        from gyre.traj.materialize import materialize, prepare_step

        # a group trains with its evaluated members; the others are recorded with their reason
        usable = [self.records[eid] for eid, e in g.executions.items() if e.usable]
        for eid, e in g.executions.items():
            if not e.usable:
                self._ledger(eid, g, admitted=False, reason=self.ended[eid][1])
        if len(usable) == 1 and self.cfg.train.advantage != "reward":  # no baseline: no signal, zero advantage
            self._ledger(usable[0].execution_id, g, admitted=False,
                         reason=f"the only evaluated member of its group of {len(g.executions)}: "
                                f"a group baseline ({self.cfg.train.advantage}) needs at least 2")
            return
        if not usable:
            return
        batch = prepare_step(usable, self.spec, step_version=g.step, estimator=self.cfg.train.advantage)
        n_step = self.cfg.run.groups_per_step * self.cfg.harness.group_size
        admitted = self.admitted.setdefault(g.id, [])
        for sel in batch.executions:  # weights are per step: every execution of the step counts equally
            sel.weight = 1.0 / max(1, sel.n_targets) / n_step
            admitted.append((sel.record.execution_id, sel.staleness))
        for eid, reason in batch.skipped:
            self._ledger(eid, g, admitted=False, reason=reason)
        if batch.executions:
            work = {}
            for mb in materialize(batch.executions, layout=self.cfg.train.layout,
                                  micro_batch_tokens=self.cfg.train.micro_batch_tokens, temperature=1.0):
                mid = next(self.mb_ids)
                self.batches[mid] = to_wire(mb)
                work[mid] = float(mb.input_ids.numel())
            self.core.microbatches_added(g.id, work)

    # ==== training ==============================================================================
    def _dispatch(self) -> None:
        for cell in self.cells:
            if cell.role is Role.TRAIN and cell.mb_in_flight is None and not self._locks[cell.id].locked():
                mid = self.core.next_microbatch()
                if mid is None:
                    return
                cell.mb_in_flight = mid
                self._spawn(self._train(cell, mid))

    async def _train(self, cell: Cell, mid: int) -> None:
        t = time.time()
        step = self.core.step.index
        rep = await self._cmd_train(cell, step, mid)
        cell.mb_in_flight = None
        cell.busy_intervals.append((t, time.time()))
        stats = rep.info.get("stats", {}) if rep.ok else {}
        self._emit(MicroBatchDone(t, time.time(), cell.id, mid, step, rep.ok, stats))
        if rep.ok:
            self.core.microbatch_trained(mid)
            cell.step_mbs.add(mid)
        else:  # its trainer died: this micro-batch and the ones it held go back to the queue
            self._requeue(cell, (set(rep.info.get("lost", [])) & cell.step_mbs) | {mid})

    def _requeue(self, cell: Cell, lost: set[int]) -> None:
        cell.step_mbs.difference_update(lost)
        self.core.microbatches_lost(sorted(lost))

    def _lost_at_prepare(self, cell: Cell, rep: Reply) -> set[int]:
        """Micro-batches whose gradients this cell no longer holds. The agent reports every
        micro-batch it lost in the step, again at each prepare_reduce; one already requeued (and
        trained again, maybe on another cell) must not be requeued again, or the step never
        ends and its gradient would count twice. So what it says it *holds* decides."""
        if rep.ok and "mb_ids" in rep.info:
            return cell.step_mbs - set(rep.info["mb_ids"])
        return set(rep.info.get("lost", [])) & cell.step_mbs

    async def _finish_step(self) -> None:
        index = self.core.step.index
        ended = False
        try:
            self._flush(force=True)  # the step's executions are on disk before anything is applied
            participants = [c for c in self.cells if c.role is not Role.FAILED and (c.step_mbs or c.role is Role.TRAIN)]
            if not any(c.role is Role.TRAIN for c in participants):
                return  # no trainer to apply the step: wait for the policy to bring one
            reps = await asyncio.gather(*(self._cmd_prepare_reduce(c, index) for c in participants))
            lost = False
            for c, r in zip(participants, reps):
                gone = self._lost_at_prepare(c, r)
                if gone or not r.ok:
                    self._requeue(c, gone)
                    lost = True
            if lost:
                return  # lost gradients are recomputed; the next tick finishes the step again
            leader = min((c for c in participants if c.role is Role.TRAIN), key=lambda c: c.id)
            new = index + 1
            t = time.time()
            reps = await asyncio.gather(*(self._cmd_reduce(c, index, participants, leader, new) for c in participants))
            bad = [f"cell {r.cell}: {r.error.splitlines()[0] if r.error else 'failed'}" for r in reps if not r.ok]
            if bad and all(r.ok or getattr(r, "retry", False) for r in reps):
                # no cell applied the step (a trainer died before the commit): hand the lost
                # micro-batches out again; the next tick reduces again
                for c, r in zip(participants, reps):
                    self._requeue(c, set(getattr(r, "lost", [])) & c.step_mbs)
                self.events.append({"t": time.time() - self.t0, "cell": None, "kind": "reduce_retry",
                                    "info": {"step": index, "why": bad}})
                return
            if bad:  # replicas may now disagree: stop rather than train on
                self.errors.append(f"step {index}: reduce failed: {'; '.join(bad)}")
                self._stop.set()
                return
            reduce_s = time.time() - t
            res = self._step_ended(time.time())
            ended = True
            push_s = 0.0
            if res.push_due:  # end of a rollout round: rollout cells get the new weights
                t = time.time()
                await asyncio.gather(*(self._cmd_push(c, res.version) for c in self.cells if c.role is Role.ROLLOUT))
                push_s = time.time() - t
            self._step_committed(res, participants, reps, reduce_s, push_s)
        finally:
            if not ended:
                self.core.step_aborted()

    def _step_ended(self, now: float) -> StepResult:
        """The optimizer step was applied on every participant: the version moves on."""
        faults.hit("head", "step_end")
        return self.core.step_ended(now)

    def _step_committed(self, res: StepResult, participants: list[Cell], reps: list[Reply], reduce_s: float,
                        push_s: float) -> None:
        """(Weights pushed if the round ended) the step is written down; the next one fills."""
        if res.push_due:
            self.core.weights_pushed(res.version)
        self._close_step(res, participants, reps, reduce_s, push_s)
        self._on_admission(res.admission)

    def _close_step(self, res: StepResult, participants: list[Cell], reps: list[Reply], reduce_s: float,
                    push_s: float) -> None:
        """Step rows and ledger lines, then state.json: the commit point of the step."""
        for g in res.groups:  # written only now: admitted means trained in this step
            for eid, stal in self.admitted.pop(g.id, []):
                self._ledger(eid, g, admitted=True, staleness=stal, step=res.index)
        # the driver's figures of the step's micro-batches: off-policy weights, mismatch, MoE aux loss
        st = self.stats.microbatch_stats(res.microbatches)
        merged = merge(st, parallel=False)
        mismatch = summarize(merged)
        extra = {
            # the loss of a GRPO step is ~0 by construction; what moves is the surrogate's scale
            "loss_per_target": merged["loss"] / merged["targets"] if merged.get("targets") else None,
            "is_weight_mean": merged.get("is_weight_mean"), "clip_frac": merged.get("clip_frac"),
            "replaced_zero_variance": res.replaced,
            "replaced_share": res.replaced / (res.replaced + len(res.groups)) if res.groups else 0.0,
            **mismatch}
        aux = [x["moe_aux_loss"] for x in st if x.get("moe_aux_loss") is not None]
        if aux:  # MoE models: the load-balancing loss, mean over the step's micro-batches
            extra["moe_aux_loss"] = statistics.fmean(aux)
        row = self._emit(StepEnded(
            res.started_at or res.ended_at, res.ended_at, res.index, res.version,
            tuple(GroupLag(g.id, g.version, g.lag_steps, g.lag_syncs, g.train_tokens) for g in res.groups),
            tuple(res.microbatches), tuple(c.id for c in participants), res.push_due, reduce_s, push_s,
            next((r.grad_norm for r in reps if getattr(r, "grad_norm", None) is not None), None), extra))
        warning = lag0_warning(mismatch, self.cfg.train.mismatch_warn_k3)
        if warning:
            self.events.append({"t": res.ended_at - self.t0, "cell": None, "kind": "mismatch_warning",
                                "info": {"step": res.index, "why": warning}})
            if not any(w.startswith("train/inference mismatch") for w in self.warnings):
                self.warnings.append(warning)
                print(f"gyre: warning: step {res.index}: {warning}", file=sys.stderr, flush=True)
        self.steps_file.write(json.dumps(row) + "\n")
        self._committed = res.version
        for c in self.cells:  # the next step may already be training: free only this step's
            c.step_mbs.difference_update(res.microbatches)
        for m in res.microbatches:
            self.batches.pop(m, None)
        self._save_state()

    # ==== ledger ================================================================================
    def _close_ledger(self, why: str) -> None:
        """Every execution that ended and did not train gets its line, with the reason."""
        for g in self.core.unfinished():
            for eid in g.executions:
                if eid in self.ended:  # ended, and not yet given its last ledger line
                    self._ledger(eid, g, admitted=False,
                                 reason=f"{why} before step {self.core.step.index} closed (group {g.state.value})")

    def _ledger(self, eid: str, g: GroupRecord, *, admitted: bool, reason: str = "", staleness: int | None = None,
                step: int | None = None) -> None:
        reward, _ = self.ended.pop(eid, (None, ""))  # an execution's ledger line is its last word
        if not admitted:
            self._emit(ExecutionDropped(time.time(), eid, g.id, reason))
        self.ledger.write(json.dumps({
            "execution": eid, "group": g.id, "task": self.task_of[g.id].name, "admitted": admitted,
            "step": step, "staleness": staleness, "lag_syncs": g.lag_syncs if admitted else None,
            "reason": reason, "reward": reward,
            "version": g.version, "sync": g.sync}) + "\n")

    # ==== persistence ===========================================================================
    def _write_cells(self, now: float) -> None:
        """cells.json: what each cell is doing now (for `gyre status`, operators, fault tests)."""
        self._cells_written = now
        rows = [{"cell": c.id, "role": c.role.value, "since": c.since - self.t0, "engine_url": c.engine_url,
                 "mb_in_flight": c.mb_in_flight, **{k: self.cell_info.get(c.id, {}).get(k)
                                                    for k in ("hostname", "engine_pid", "trainer_pid")}}
                for c in self.cells]
        atomic_write_json(self.run_dir / "cells.json", {"version": self.version,
                                                         "step_mbs_left": len(self.core.step.queue),
                                                         "cells": rows})

    def _flush(self, force: bool = False) -> None:  # noqa: ARG002 (every record is written at once now)
        if self.records_buffer:
            self.writer.write(self.records_buffer)  # durable when it returns (fsynced, renamed)
            written = [r.execution_id for r in self.records_buffer]
            self.records_buffer = []
            self._unwritten.difference_update(written)
            self._release(written)

    def _save_state(self) -> None:
        self._flush(force=True)  # shards first: state never points past what is on disk
        self._write_state()

    def _write_state(self) -> None:
        # the last *committed* step: a step that ended but is not yet written down (its weights
        # still being pushed) is redone after a hard stop, never counted as trained unrecorded
        v = self._committed
        atomic_write_json(self.run_dir / "state.json", {
            "version": v, "rollout_version": min(v, self.core.rollout_version), "groups_started": self.core.next_group,
            "weights": self.weights_path(v), "checkpoint": self.checkpoint_path(v)})

    def _load_state(self) -> tuple[int, int]:
        """(version, next group id) of the last committed step; the ledger is reconciled with it."""
        path = self.run_dir / "state.json"
        if not path.exists():
            return 0, 0
        st = json.loads(path.read_text())
        version = int(st["version"])
        # groups of unfinished steps are rerun under new ids; what they recorded is in the shards
        # and (after `_reconcile`) in the ledger as not admitted, so nothing trains twice
        self._reconcile(version)
        return version, int(st["groups_started"])

    def _reconcile(self, version: int) -> None:
        """Make ledger.jsonl and steps.jsonl agree with the committed state after a hard stop.

        A head killed between a step's ledger lines and state.json leaves lines for a step that
        the resumed job redoes (the trainer restarts from the committed checkpoint): those become
        not admitted. Executions in the shards with no ledger line (killed before they were
        recorded) get one. Rewritten atomically, once, before the resumed job appends."""
        from gyre.traj.store import iter_executions

        ledger_path, steps_path = self.run_dir / "ledger.jsonl", self.run_dir / "steps.jsonl"
        lines = ledger_path.read_text().splitlines() if ledger_path.exists() else []
        out, seen = [], set()
        for line in lines:
            row = json.loads(line)
            if "execution" in row:
                if row["admitted"] and row["step"] is not None and row["step"] >= version:
                    row = {**row, "admitted": False, "staleness": None, "lag_syncs": None,
                           "reason": f"step {row['step']} rolled back: the head stopped before it was committed"}
                seen.add(row["execution"])
            out.append(json.dumps(row))
        for rec in iter_executions(self.cfg.shard_dir()):
            if rec.execution_id not in seen:
                seen.add(rec.execution_id)
                out.append(json.dumps({"execution": rec.execution_id, "group": rec.group, "task": rec.task,
                                       "admitted": False, "step": None, "staleness": None, "lag_syncs": None,
                                       "reason": "the head stopped before this execution was admitted or recorded",
                                       "reward": None, "version": rec.min_version, "sync": None}))
        ws_dir = self.run_dir / "workspaces"
        for ws in sorted(ws_dir.iterdir()) if ws_dir.is_dir() else ():
            m = _EXECUTION_ID.match(ws.name)
            if m and ws.name not in seen:  # it was running when the head died: no record of it exists
                seen.add(ws.name)
                out.append(json.dumps({"execution": ws.name, "group": int(m["group"]), "task": m["task"],
                                       "admitted": False, "step": None, "staleness": None, "lag_syncs": None,
                                       "reason": "lost: it was running when the head was killed; its calls were "
                                                 "not recorded (its group is rerun)",
                                       "reward": None, "version": None, "sync": None}))
        atomic_write_text(ledger_path, "".join(line + "\n" for line in out))
        if steps_path.exists():
            keep = [line for line in steps_path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] < version]
            atomic_write_text(steps_path, "".join(line + "\n" for line in keep))

    def _stopped_to_replay(self) -> dict[tuple[str, int], list]:
        """(task, member) -> [(execution id, tree)] of executions the stopped job was running
        (status ``stopped``, calls recorded, never resumed yet): a new group of the same task
        resumes them by replay, member for member (gyre.proxy.replay)."""
        from gyre.traj.store import iter_executions

        done = set()  # recordings already taken by a resumed execution ("resuming" lines)
        path = self.run_dir / "ledger.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            if '"resuming"' in line:
                done.add(json.loads(line).get("from"))
        out: dict[tuple[str, int], list] = {}
        for rec in iter_executions(self.cfg.shard_dir()):
            m = _EXECUTION_ID.match(rec.execution_id)
            if m and rec.status == "stopped" and rec.tree.calls and rec.execution_id not in done:
                out.setdefault((rec.task, int(m["member"])), []).append((rec.execution_id, rec.tree))
        return out

    # ==== report ================================================================================
    def report(self, t1: float, stopped: bool) -> dict:
        """report.json: every figure from the events (gyre/events.py); no shard is read back."""
        st = self.stats
        cells = [{**st.cell_time(c.id, t1), "hostname": c.hostname, "switch_phases": c.switch_phases}
                 for c in self.cells]
        s = self.cfg.sched
        executions = dict(st.status_counts)
        return {"stopped_reason": self.pool.broken if self.pool else None, "unscorable": dict(self.unscorable),
                "scheme": s.scheme, "label": f"{s.scheme}{s.staleness}", "staleness": s.staleness,
                "staleness_rule": s.staleness_rule, "steps_per_sync": s.steps_per_sync,
                "lag": asdict(st.lag()), "groups_dropped": st.groups_dropped,
                "groups_started": self.core.started,
                "steps": st.steps, "cells": cells, "wall_s": t1 - self.t0, "stopped": stopped,
                "errors": self.errors + (self.metrics.errors if self.metrics else []), "warnings": self.warnings,
                "harness_errors": executions.get("failed", 0) + executions.get("crashed", 0), "events": self.events,
                "groups_replaced_zero_variance": self.core.zero_variance_dropped,
                "executions": executions, "version": self.version,
                "intervals": {c.id: st.intervals(c.id, t1) for c in self.cells},
                "idle": {c.id: st.idle_spans(c.id, t1) for c in self.cells},
                "metrics": self.metrics.describe() if self.metrics else None}

    def _urls_of(self, cell: Cell) -> set[str]:
        return {cell.engine_url, *cell.old_urls}
