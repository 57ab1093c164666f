"""The head (MPI rank 0): live coordinator, proxy, router, harness pool, evaluators, shard writer.

One loop, read top to bottom in `Head.tick`:

1. build the `ClusterState` the policy sees (cells, running executions, groups, open step);
2. `policy.decide(state, now)` (the same object the simulator drives);
3. apply its role switches (each a protocol exchange with the cell agent) and start groups;
4. admit evaluated groups to the open step within the staleness bound, materialize them into
   micro-batches, and hand micro-batches to idle train cells (work goes by progress);
5. when the step's micro-batches are all trained: the cells that took part reduce gradients
   together, take one optimizer step, the policy version increases and rollout cells get the
   new weights.

Everything that ends is written down: executions to HDF5 shards, which execution trained in
which step (or why not) to ``ledger.jsonl``, per-step figures to ``steps.jsonl``, and the state
needed by ``--resume`` to ``state.json``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import secrets
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from gyre.fsio import atomic_write_json
from gyre.config import GyreConfig, default_tiny_dir
from gyre.sched.cells import Cell, cell_stats
from gyre.sched.protocol import (Command, Event, PrepareReduce, PushWeights, Reduce, Reply, Stop, ToRollout, ToTrain,
                                 Train, reply_for)
from gyre.rollout import FINISHED
from gyre.sched.state import ClusterState, ExecView, GroupView, Role


@dataclass
class Group:
    id: int
    task: object
    started_version: int
    started_at: float
    execution_ids: list[str] = field(default_factory=list)
    records: dict = field(default_factory=dict)     # execution id -> ExecutionRecord
    ready_at: float = 0.0
    version: int = -1                               # oldest policy version that served it
    state: str = "running"                          # running | waiting | assigned | trained | dropped
    step: int = -1
    train_tokens: float = 0.0

    def view(self) -> GroupView:
        return GroupView(self.id, self.version, self.ready_at, self.train_tokens)


@dataclass
class OpenStep:
    index: int
    groups: list[int] = field(default_factory=list)
    queue: list[int] = field(default_factory=list)        # micro-batch ids waiting for a cell
    batches: dict = field(default_factory=dict)           # mb id -> wire dict
    tokens: dict = field(default_factory=dict)            # mb id -> tokens
    done: set = field(default_factory=set)
    started_at: float = 0.0
    stats: list = field(default_factory=list)
    reducing: bool = False
    admitted: list = field(default_factory=list)          # (execution id, group id, staleness)

    @property
    def tokens_left(self) -> float:
        return float(sum(t for m, t in self.tokens.items() if m not in self.done))


class Head:
    def __init__(self, cfg: GyreConfig, link, n_cells: int, *, resume: bool = False):
        self.cfg, self.link, self.resume = cfg, link, resume
        self.run_dir = Path(cfg.run.dir)
        self.cells = [Cell(i, i + 1) for i in range(n_cells)]
        self.version = 0
        self.groups: dict[int, Group] = {}
        self.groups_started = 0                          # next group id: never reused, across resumes
        self.start_version = 0                           # version when this job started (resume)
        self.mb_ids = itertools.count()
        self.step = OpenStep(0)
        self.step_log: list[dict] = []
        self.running: dict[str, tuple[Group, float]] = {}  # execution id -> (group, started_at)
        self._futures: dict[int, asyncio.Future] = {}
        self._locks = [asyncio.Lock() for _ in range(n_cells)]
        self._hello = asyncio.Event()
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self.t0 = time.time()
        self.records_buffer: list = []
        self.errors: list[str] = []
        self.events: list[dict] = []      # restarts and failures, for the report
        self.cell_info: dict[int, dict] = {}
        self._cells_written = 0.0
        self.harness_errors = 0
        self.status_counts: dict[str, int] = {}

    # ---- messages from cells (called in the event loop) -----------------------------------
    def on_message(self, msg) -> None:
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
                cell.set_role(Role.FAILED, now)

    async def _replace_endpoint(self, cell: Cell, old: str) -> None:
        await self.router.remove_endpoint(old, abort=True)
        if cell.role is Role.ROLLOUT:
            await self._call(cell, PushWeights(version=self.version, weights=self.weights_path()))
            self.router.add_endpoint(cell.engine_url)

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

    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    # ---- paths -----------------------------------------------------------------------------
    def weights_path(self, version: int | None = None) -> str:
        v = self.version if version is None else version
        if v == 0:
            return str(self.model_dir)
        return str(self.weights_root / f"v{v}")

    def checkpoint_path(self, version: int | None = None) -> str:
        v = self.version if version is None else version
        return "" if v == 0 else str(self.ckpt_root / f"v{v}")

    # ---- the run ---------------------------------------------------------------------------
    async def run(self) -> dict:
        from gyre.engine.router import Router
        from gyre.engine.tiny_model import ensure_tiny_model, load_tokenizer, model_identity
        from gyre.harness.evaluator import EvaluatorPool
        from gyre.harness.runner import HarnessPool, private_dir
        from gyre.proxy.server import Proxy, create_app, start_site
        from gyre.rollout import load_tasks, shard_identity
        from gyre.sched import policy_from_config
        from gyre.traj.select import SelectionSpec
        from gyre.traj.store import ShardWriter

        cfg = self.cfg
        private_dir(self.run_dir)
        self.model_dir = Path(cfg.model.path or ensure_tiny_model(default_tiny_dir(cfg)))
        self.weights_root = Path(cfg.train.export_dir or self.run_dir / "weights")
        self.ckpt_root = Path(cfg.train.checkpoint_dir or self.run_dir / "checkpoints")
        self.policy = policy_from_config(cfg)
        self.spec = SelectionSpec.from_config(cfg.selection)
        self.tasks = load_tasks(cfg)  # harness.suite, strict_suite, image_template, tasks
        self.task_cycle = itertools.cycle(self.tasks)
        identity = model_identity(self.model_dir)
        self.writer = ShardWriter.from_config(cfg.store, private_dir(cfg.shard_dir()), shard_identity(identity))
        self.ledger = open(self.run_dir / "ledger.jsonl", "a", buffering=1)
        self.steps_file = open(self.run_dir / "steps.jsonl", "a", buffering=1)
        if self.resume:
            self._load_state()
        self.start_version = self.version
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
        roles = self.policy.initial_roles(len(self.cells))
        self.router = Router([], api_key=self.link.engine_key, timeout_s=cfg.engine.request_timeout_s,
                             wait_for_endpoint_s=120.0)
        for cell, role in zip(self.cells, roles):
            cell.since, cell.last_seen = now, now
            if role is Role.ROLLOUT:
                self.router.add_endpoint(cell.engine_url)
        # cells boot as rollout; the policy's initial train cells switch once, before any work
        await asyncio.gather(*(self._to_train(c) for c, r in zip(self.cells, roles) if r is Role.TRAIN))
        if self.version > 0:
            await asyncio.gather(*(self._call(c, PushWeights(version=self.version, weights=self.weights_path()))
                                   for c in self.cells if c.role is Role.ROLLOUT))
        self.proxy = Proxy(self.router, load_tokenizer(self.model_dir), identity=identity,
                           default_max_tokens=cfg.proxy.default_max_tokens, max_tokens_cap=cfg.proxy.max_tokens_cap)
        runner, port = await start_site(create_app(self.proxy, admin_key=secrets.token_urlsafe(24),
                                                   max_body_bytes=cfg.proxy.max_body_bytes), cfg.proxy.host, cfg.proxy.port)
        self.base_url = f"http://{cfg.proxy.host}:{port}/v1"
        self.pool = HarnessPool.from_config(cfg)
        self.evaluators = EvaluatorPool.from_config(cfg)
        stopped = False
        try:
            while self.version < cfg.run.steps:
                if self._stop.is_set():
                    stopped = True
                    break
                await self.tick(time.time())
                await asyncio.sleep(0.1)
        finally:
            await self.pool.stop_all()
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
            self._flush(force=True)
            self._close_ledger("run stopped" if stopped else "run ended")
            if stopped:
                self._save_state()  # the groups started since the last step close are counted: ids never reused
            self.evaluators.shutdown(wait=True)
            await runner.cleanup()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        t1 = time.time()
        for c in self.cells:
            c.close(t1)
        await asyncio.gather(*(self._call(c, Stop(), timeout=60) for c in self.cells))
        await self.router.close()
        self.ledger.close()
        self.steps_file.close()
        return self.report(t1, stopped)

    # ---- one tick ----------------------------------------------------------------------------
    async def tick(self, now: float) -> None:
        self._check_heartbeats(now)
        if now - self._cells_written > 0.5:
            self._write_cells(now)
        decision = self.policy.decide(self.state(now), now)
        for sw in decision.switches:
            cell = self.cells[sw.cell]
            if sw.to is Role.TRAIN and cell.role is Role.ROLLOUT:
                cell.set_role(Role.TO_TRAIN, now)
                self._spawn(self._to_train(cell))
            elif sw.to is Role.ROLLOUT and cell.role is Role.TRAIN:
                cell.set_role(Role.TO_ROLLOUT, now)
                self._spawn(self._to_rollout(cell))
        for _ in range(decision.start_groups):
            self._start_group(now)
        self._admit(now)
        self._dispatch()
        if self._step_complete():
            self.step.reducing = True
            self._spawn(self._finish_step())

    def state(self, now: float) -> ClusterState:
        q = self.cfg.run.groups_per_step
        open_groups = sum(1 for g in self.groups.values() if g.state in ("running", "waiting", "assigned"))
        waiting = sum(1 for g in self.groups.values() if g.state == "waiting")
        started = len(self.groups)  # groups started by this job (a resumed job starts at its version)
        total = (self.cfg.run.steps - self.start_version) * q
        tokens_left = self.step.tokens_left + (1.0 if self.step.reducing else 0.0)
        running = tuple(ExecView(i, g.id, g.started_version, t, 0, False)
                        for i, (eid, (g, t)) in enumerate(sorted(self.running.items())))
        return ClusterState(
            version=self.version, staleness=self.cfg.sched.staleness, groups_per_step=q,
            group_size=self.cfg.harness.group_size, cells=tuple(c.view() for c in self.cells),
            running=running, groups_open=open_groups, groups_waiting=waiting,
            step_groups=len(self.step.groups), train_tokens_left=tokens_left,
            train_tokens_done=float(sum(self.step.tokens[m] for m in self.step.done)),
            starts_blocked=started >= total)

    def _check_heartbeats(self, now: float) -> None:
        limit = self.cfg.run.heartbeat_timeout_s
        for c in self.cells:
            if c.role is not Role.FAILED and now - c.last_seen > limit:
                self.errors.append(f"cell {c.id} silent for {now - c.last_seen:.0f} s: marked failed")
                c.set_role(Role.FAILED, now)
                self._spawn(self.router.remove_endpoint(c.engine_url, abort=True))

    # ---- switches ----------------------------------------------------------------------------
    async def _to_train(self, cell: Cell) -> None:
        t = time.time()
        cell.set_role(Role.TO_TRAIN, t)
        await self.router.remove_endpoint(cell.engine_url, abort=True)  # aborted calls retry elsewhere
        rep = await self._call(cell, ToTrain(version=self.version, checkpoint=self.checkpoint_path() or None))
        cell.switch_phases.append({"to": "train", "ok": rep.ok, "wall_s": time.time() - t, **rep.phases})
        if rep.ok:
            cell.set_role(Role.TRAIN, time.time())
        else:
            self.errors.append(f"cell {cell.id} to_train failed: {rep.error}")
            cell.set_role(Role.FAILED, time.time())

    async def _to_rollout(self, cell: Cell) -> None:
        t = time.time()
        version = self.version
        rep = await self._call(cell, ToRollout(version=version, weights=self.weights_path(version)))
        cell.switch_phases.append({"to": "rollout", "ok": rep.ok, "wall_s": time.time() - t, **rep.phases})
        if not rep.ok:
            self.errors.append(f"cell {cell.id} to_rollout failed: {rep.error}")
            cell.set_role(Role.FAILED, time.time())
            return
        if self.version != version:  # a step ended while it switched: load the newest weights first
            await self._call(cell, PushWeights(version=self.version, weights=self.weights_path()))
        self.router.add_endpoint(cell.engine_url)
        cell.set_role(Role.ROLLOUT, time.time())

    # ---- executions ----------------------------------------------------------------------------
    def _start_group(self, now: float) -> None:
        g = Group(self.groups_started, next(self.task_cycle), self.version, now)
        self.groups_started += 1
        self.groups[g.id] = g
        for k in range(self.cfg.harness.group_size):
            eid = f"q{g.id}-{g.task.name}-g{k}"
            g.execution_ids.append(eid)
            self.running[eid] = (g, now)
            self._spawn(self._execution(g, eid))

    async def _execution(self, g: Group, eid: str) -> None:
        from gyre.rollout import run_and_evaluate

        rec = await run_and_evaluate(self.proxy, self.pool, self.evaluators, g.task, eid, g.id, self.base_url)
        self.running.pop(eid, None)
        self.status_counts[rec.status] = self.status_counts.get(rec.status, 0) + 1
        self.harness_errors += rec.status in ("failed", "crashed")
        g.records[eid] = rec
        self.records_buffer.append(rec)
        self._flush()
        if len(g.records) == len(g.execution_ids):
            self._group_ready(g, time.time())

    def _group_ready(self, g: Group, now: float) -> None:
        versions = [r.min_version for r in g.records.values() if r.min_version >= 0]
        g.version = min(versions) if versions else g.started_version
        g.ready_at, g.state = now, "waiting"
        g.train_tokens = float(sum(r.tree.stats().unique_tokens for r in g.records.values()))

    def _admit(self, now: float) -> None:
        from gyre.sched.admission import expired, pick

        k = self.cfg.sched.staleness
        for g in self.groups.values():
            if g.state == "waiting" and expired(self.step.index, g.version, k):
                g.state = "dropped"
                for eid, rec in g.records.items():
                    self._ledger(eid, g, admitted=False, reason=f"stale: served by v{g.version}, step {self.step.index}, bound {k}")
        if self.step.reducing:
            return
        room = self.cfg.run.groups_per_step - len(self.step.groups)
        waiting = [g.view() for g in self.groups.values() if g.state == "waiting"]
        for gv in pick(waiting, self.step.index, k, room, self.policy.admission_key):
            self._assign(self.groups[gv.id])

    def _assign(self, g: Group) -> None:
        from gyre.batch import to_wire
        from gyre.traj.materialize import materialize, prepare_step

        g.state, g.step = "assigned", self.step.index
        self.step.groups.append(g.id)
        if not self.step.started_at:
            self.step.started_at = time.time()
        usable = [r for r in g.records.values() if r.status in FINISHED and math.isfinite(r.reward)]
        for eid, rec in g.records.items():
            if rec not in usable:
                self._ledger(eid, g, admitted=False, reason=rec.reward_source or f"status {rec.status}")
        if not usable:
            return
        batch = prepare_step(usable, self.spec, step_version=self.step.index, estimator=self.cfg.train.advantage)
        n_step = self.cfg.run.groups_per_step * self.cfg.harness.group_size
        for sel in batch.executions:  # weights are per step: every execution of the step counts equally
            sel.weight = 1.0 / max(1, sel.n_targets) / n_step
            self.step.admitted.append((sel.record.execution_id, g.id, sel.staleness))
        for eid, reason in batch.skipped:
            self._ledger(eid, g, admitted=False, reason=reason)
        if batch.executions:
            mats = materialize(batch.executions, layout=self.cfg.train.layout,
                               micro_batch_tokens=self.cfg.train.micro_batch_tokens, temperature=1.0)
            for mb in mats:
                mid = next(self.mb_ids)
                self.step.batches[mid] = to_wire(mb)
                self.step.tokens[mid] = float(mb.input_ids.numel())
                self.step.queue.append(mid)

    def _close_ledger(self, why: str) -> None:
        """Every execution that ended and did not train gets its line, with the reason."""
        for g in self.groups.values():
            if g.state in ("trained", "dropped"):
                continue
            for eid in g.records:
                self._ledger(eid, g, admitted=False, reason=f"{why} before step {self.step.index} closed (group {g.state})")

    def _ledger(self, eid: str, g: Group, *, admitted: bool, reason: str = "", staleness: int | None = None,
                step: int | None = None) -> None:
        rec = g.records.get(eid)
        self.ledger.write(json.dumps({
            "execution": eid, "group": g.id, "task": g.task.name, "admitted": admitted,
            "step": step, "staleness": staleness, "reason": reason,
            "reward": None if rec is None or not math.isfinite(rec.reward) else rec.reward,
            "version": g.version}) + "\n")

    # ---- training ----------------------------------------------------------------------------
    def _dispatch(self) -> None:
        for cell in self.cells:
            if not self.step.queue:
                return
            if cell.role is Role.TRAIN and cell.mb_in_flight is None and not self._locks[cell.id].locked():
                mid = self.step.queue.pop(0)
                cell.mb_in_flight = mid
                self._spawn(self._train(cell, mid))

    async def _train(self, cell: Cell, mid: int) -> None:
        t = time.time()
        rep = await self._call(cell, Train(step=self.step.index, mb_id=mid, batch=self.step.batches[mid]))
        cell.mb_in_flight = None
        cell.busy_intervals.append((t, time.time()))
        if rep.ok:
            self.step.done.add(mid)
            cell.step_mbs.add(mid)
            self.step.stats.append(rep.stats)
        else:  # its trainer died: this micro-batch and the ones it held go back to the queue
            lost = set(getattr(rep, "lost", [])) | {mid}
            self._requeue(cell, lost)

    def _requeue(self, cell: Cell, lost: set[int]) -> None:
        for m in lost:
            self.step.done.discard(m)
            cell.step_mbs.discard(m)
            if m not in self.step.queue:
                self.step.queue.append(m)

    def _step_complete(self) -> bool:
        s = self.step
        if s.reducing or not s.groups or s.queue or any(c.mb_in_flight is not None for c in self.cells):
            return False
        if len(s.groups) < self.cfg.run.groups_per_step:
            return False
        if any(not c.role.settled and c.role is not Role.FAILED for c in self.cells):
            return False  # a cell mid-switch would miss the step; wait until it lands
        return True

    async def _finish_step(self) -> None:
        s = self.step
        try:
            participants = [c for c in self.cells if c.role is not Role.FAILED and (c.step_mbs or c.role is Role.TRAIN)]
            if not any(c.role is Role.TRAIN for c in participants):
                return  # no trainer to apply the step: wait for the policy to bring one
            reps = await asyncio.gather(*(self._call(c, PrepareReduce(step=s.index)) for c in participants))
            lost = False
            for c, r in zip(participants, reps):
                if not r.ok or getattr(r, "lost", None):
                    self._requeue(c, set(getattr(r, "lost", [])))
                    lost = True
            if lost:
                return  # lost gradients are recomputed; the next tick finishes the step again
            leader = min((c for c in participants if c.role is Role.TRAIN), key=lambda c: c.id)
            new = self.version + 1
            args = {"step": s.index, "participants": [c.id for c in participants], "leader": leader.id,
                    "weights_dir": str(self.weights_root / f"v{new}"), "checkpoint_dir": str(self.ckpt_root / f"v{new}")}
            t = time.time()
            reps = await asyncio.gather(*(self._call(c, Reduce(**args)) for c in participants))
            bad = [f"cell {r.cell}: {r.error.splitlines()[0] if r.error else 'failed'}" for r in reps if not r.ok]
            if bad and all(r.ok or getattr(r, "retry", False) for r in reps):
                # no cell applied the step (a trainer died before the commit): hand the lost
                # micro-batches out again; the next tick reduces again
                for c, r in zip(participants, reps):
                    self._requeue(c, set(getattr(r, "lost", [])))
                self.events.append({"t": time.time() - self.t0, "cell": None, "kind": "reduce_retry",
                                    "info": {"step": s.index, "why": bad}})
                return
            if bad:  # replicas may now disagree: stop rather than train on
                self.errors.append(f"step {s.index}: reduce failed: {'; '.join(bad)}")
                self._stop.set()
                return
            reduce_s = time.time() - t
            self.version = new
            pushes = [c for c in self.cells if c.role is Role.ROLLOUT]
            t = time.time()
            await asyncio.gather(*(self._call(c, PushWeights(version=new, weights=self.weights_path()))
                                   for c in pushes))
            self._close_step(s, participants, reps, reduce_s, time.time() - t)
        finally:
            s.reducing = False

    def _close_step(self, s: OpenStep, participants: list[Cell], reps: list[Reply], reduce_s: float, push_s: float) -> None:
        rewards = [r.reward for gid in s.groups for r in self.groups[gid].records.values() if math.isfinite(r.reward)]
        stal = [self.step.index - self.groups[gid].version for gid in s.groups]
        for gid in s.groups:
            self.groups[gid].state = "trained"
        for eid, gid, stal_e in s.admitted:  # written only now: admitted means trained in this step
            self._ledger(eid, self.groups[gid], admitted=True, staleness=stal_e, step=s.index)
        losses = [st.get("loss", 0.0) for st in s.stats]
        ratios = [st["ratio_mean"] for st in s.stats if st.get("ratio_mean") is not None]
        kls = [st["kl_old"] for st in s.stats if st.get("kl_old") is not None]
        row = {"step": s.index, "version": self.version, "groups": len(s.groups), "micro_batches": len(s.batches),
               "participants": [c.id for c in participants], "reward_mean": statistics.fmean(rewards) if rewards else None,
               "reward_n": len(rewards), "staleness_mean": statistics.fmean(stal) if stal else 0, "staleness_max": max(stal, default=0),
               "loss": sum(losses), "ratio_mean": statistics.fmean(ratios) if ratios else None,
               "kl_old_max": max(kls, default=None), "grad_norm": next((r.grad_norm for r in reps if getattr(r, "grad_norm", None) is not None), None),
               "reduce_s": reduce_s, "push_s": push_s, "t_start": s.started_at - self.t0, "t_end": time.time() - self.t0}
        self.step_log.append(row)
        self.steps_file.write(json.dumps(row) + "\n")
        for c in self.cells:
            c.step_mbs.clear()
        self.step = OpenStep(self.version)
        self._save_state()

    # ---- persistence -------------------------------------------------------------------------
    def _write_cells(self, now: float) -> None:
        """cells.json: what each cell is doing now (for `gyre status`, operators, fault tests)."""
        self._cells_written = now
        rows = [{"cell": c.id, "role": c.role.value, "since": c.since - self.t0, "engine_url": c.engine_url,
                 "mb_in_flight": c.mb_in_flight, **{k: self.cell_info.get(c.id, {}).get(k)
                                                    for k in ("hostname", "engine_pid", "trainer_pid")}}
                for c in self.cells]
        atomic_write_json(self.run_dir / "cells.json", {"version": self.version, "step_mbs_left": len(self.step.queue),
                                                         "cells": rows})

    def _flush(self, force: bool = False) -> None:
        if self.records_buffer and (force or len(self.records_buffer) >= self.cfg.store.executions_per_shard):
            self.writer.write(self.records_buffer)
            self.records_buffer = []

    def _save_state(self) -> None:
        self._flush(force=True)  # shards first: state never points past what is on disk
        atomic_write_json(self.run_dir / "state.json", {"version": self.version, "groups_started": self.groups_started,
                                                         "weights": self.weights_path(), "checkpoint": self.checkpoint_path()})

    def _load_state(self) -> None:
        path = self.run_dir / "state.json"
        if not path.exists():
            return
        st = json.loads(path.read_text())
        self.version = int(st["version"])
        self.step = OpenStep(self.version)
        # groups of unfinished steps are rerun: what they recorded is in the shards and in the
        # ledger as not admitted, so nothing trains twice
        self.groups_started = int(st["groups_started"])
        self.ledger.write(json.dumps({"resume": True, "version": self.version, "at": time.time()}) + "\n")

    # ---- report ----------------------------------------------------------------------------
    def report(self, t1: float, stopped: bool) -> dict:
        from gyre.traj.store import iter_executions

        by_url: dict[str, list[tuple[float, float]]] = {}
        for rec in iter_executions(self.cfg.shard_dir()):
            for c in rec.tree.calls:
                by_url.setdefault(c.endpoint, []).append((c.t_start, c.t_end))
        cells = []
        for c in self.cells:
            busy = [iv for url, ivs in by_url.items() if url in self._urls_of(c) for iv in ivs]
            cells.append({**cell_stats(c, self.t0, t1, busy), "switch_phases": c.switch_phases})
        return {"scheme": self.cfg.sched.scheme, "label": f"{self.cfg.sched.scheme}{self.cfg.sched.staleness}",
                "steps": self.step_log, "cells": cells, "wall_s": t1 - self.t0, "stopped": stopped,
                "errors": self.errors, "harness_errors": self.harness_errors, "events": self.events,
                "executions": self.status_counts, "version": self.version,
                "intervals": {c.id: c.intervals for c in self.cells}}

    def _urls_of(self, cell: Cell) -> set[str]:
        return {cell.engine_url, *cell.old_urls}

