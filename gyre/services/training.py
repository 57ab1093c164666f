"""Training dispatch: from ended executions to an applied optimizer step.

It keeps an ended execution's full record (its tree) only until its group is materialized or
dropped (memory stays flat over a run: the record is already durable in its shard), turns the
groups the coordinator core assigns to the open step into micro-batches, hands them to idle train
cells (work goes by progress: whoever is free takes the next), requeues what a dying trainer
lost, and runs the step's two-phase reduce (prepare: who holds what; reduce: apply everywhere or
nowhere). With train.minibatches_per_step = n the core splits a full step into n parts and this
module runs one such reduce per part (the last one counts the step); the later parts' pi_prox,
asked of the trainers before the first update, is kept here and travels with each micro-batch.
Which groups train when is the core's decision, never this module's.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from gyre.events import MicroBatchDone
from gyre.sched.cells import Cell
from gyre.minibatch import minibatch_scales
from gyre.sched.core import Coordinator, GroupRecord, ProxJob
from gyre.sched.protocol import PrepareReduceReply, ReduceReply
from gyre.sched.state import Role
from gyre.traj.audit import Audit, audit_micro_batch
from gyre.traj.materialize import materialize, prepare_step
from gyre.config import trainer_config
from gyre.train.lr_schedule import LrSchedule
from gyre.train.step_stats import merge, summarize


@dataclass
class StepReduced:
    """An update (a whole step without minibatches) whose reduce every participant applied."""
    participants: list[Cell]
    replies: list[ReduceReply]
    seconds: float
    final: bool = True                                      # the step's last update: the step is done
    grad_norms: list = field(default_factory=list)          # every update of the step, in order (final)

    @property
    def grad_norm(self) -> float | None:
        return next((r.grad_norm for r in self.replies if r.grad_norm is not None), None)


class TrainingDispatch:
    def __init__(self, cfg, fleet, *, emit: Callable, clock: Callable[[], float], spawn: Callable,
                 notice: Callable[[str, dict], None] = lambda kind, info: None):
        self.cfg, self.fleet, self.emit, self.clock, self.spawn = cfg, fleet, emit, clock, spawn
        self.notice = notice                            # (kind, info): something the report should list
        self.core: Coordinator | None = None
        self.selection = None                           # gyre.traj.select.SelectionSpec, set at start-up
        self.records: dict[str, object] = {}            # execution id -> ExecutionRecord (durable already)
        self.batches: dict[int, dict] = {}              # micro-batch id -> wire dict, until its step closes
        self.audits: dict[int, Audit] = {}              # micro-batch id -> its token-identity audit
        self.admitted: dict[int, list] = {}             # group id -> [(execution id, staleness)]
        self.prox: dict[int, np.ndarray] = {}           # micro-batch id -> pi_prox at its step's start
        self.scale: dict[int, float] = {}               # micro-batch id -> its part's weight factor
        self.updates: list[StepReduced] = []            # the open step's updates applied so far
        self.mb_ids = itertools.count()

    # ---- records -------------------------------------------------------------------------------
    def hold(self, rec) -> None:
        """An ended execution's record (its shard is durable): kept until its group materializes."""
        self.records[rec.execution_id] = rec

    def release(self, eids) -> None:
        for eid in eids:
            self.records.pop(eid, None)

    # ---- materialization -----------------------------------------------------------------------
    def materialize(self, g: GroupRecord, ledger) -> None:
        """A group the core assigned to the open step becomes micro-batches; what cannot train gets
        its ledger line (``ledger``: gyre.services.ledger.Ledger) with the reason."""
        adv = self.cfg.train.advantage
        usable = [self.records[eid] for eid, e in g.executions.items() if e.usable]
        for eid, e in g.executions.items():
            if not e.usable:
                ledger.line(eid, g, admitted=False, reason=ledger.why_not(eid))
        if len(usable) == 1 and adv != "reward":  # no baseline: no signal, zero advantage
            ledger.line(usable[0].execution_id, g, admitted=False,
                        reason=f"the only evaluated member of its group of {len(g.executions)}: "
                               f"a group baseline ({adv}) needs at least 2")
            return
        if not usable:
            return
        # weights are per step: every execution of the step counts equally, whichever group it is in
        batch = prepare_step(usable, self.selection, step_version=g.step, estimator=adv,
                             step_executions=self.cfg.run.groups_per_step * self.cfg.harness.group_size)
        admitted = self.admitted.setdefault(g.id, [])
        for sel in batch.executions:
            admitted.append((sel.record.execution_id, sel.staleness))
        for eid, reason in batch.skipped:
            ledger.line(eid, g, admitted=False, reason=reason)
        if batch.executions:
            work = {}
            mat = materialize(batch.executions, layout=self.cfg.train.layout,
                              micro_batch_tokens=self.cfg.train.micro_batch_tokens,
                              routing=self.cfg.train.routing_replay)
            for i in range(len(mat)):
                wire, keys = mat.wire_with_keys(i)  # numpy, as sent: the head never imports torch
                mid = next(self.mb_ids)
                self.audits[mid] = audit_micro_batch(wire, keys, batch.executions)
                self.batches[mid] = wire
                work[mid] = float(wire["input_ids"].size)
            self.core.microbatches_added(g.id, work)

    # ---- micro-batches to train cells ----------------------------------------------------------
    def dispatch(self) -> None:
        """Every idle train cell takes the next queued micro-batch."""
        for cell in self.fleet:
            if cell.role is Role.TRAIN and cell.mb_in_flight is None and not self.fleet.busy(cell):
                mid = self.core.next_microbatch()
                if mid is None:
                    return
                prox = isinstance(mid, ProxJob)
                cell.mb_in_flight = mid.mb if prox else mid  # (cells.json: the micro-batch either way)
                self.spawn(self.prox_of(cell, mid) if prox else self.train(cell, mid))

    async def prox_of(self, cell: Cell, job: ProxJob) -> None:
        """pi_prox of a later minibatch's micro-batch, before the step's first update."""
        mid = job.mb
        rep = await self.fleet.train(cell, self.core.step.index, mid, self.batches[mid], prox=True)
        cell.mb_in_flight = None
        if rep.ok and rep.logprobs is not None:
            self.prox[mid] = np.asarray(rep.logprobs, dtype=np.float32)
            self.core.microbatch_trained(job)
        else:  # asked again; a trainer that died took the gradients it held with it
            self.requeue(cell, set(rep.lost) & cell.step_mbs)
            self.core.microbatches_lost([job])

    def _scale(self, mid: int) -> float:
        """The factor of `mid`'s part (gyre.minibatch.minibatch_scales), once per step."""
        if mid not in self.scale:
            parts = self.core.step.parts
            sums = [sum(float(self.batches[m]["weights"].sum()) for m in part) for part in parts]
            for part, f in zip(parts, minibatch_scales(sums)):
                self.scale.update(dict.fromkeys(part, f))
        return self.scale[mid]

    async def train(self, cell: Cell, mid: int) -> None:
        t = self.clock()
        step, update = self.core.step.index, self.core.step.update
        batch = self.batches[mid]
        if self.core.step.parts is not None:  # minibatches: each update is a mean over its own tokens
            batch = {**batch, "weights": batch["weights"] * np.float32(self._scale(mid))}
        if mid in self.prox:  # a later minibatch: its clip and weights act against the step's start
            batch = {**batch, "prox_logprobs": self.prox[mid]}
        rep = await self.fleet.train(cell, step, mid, batch, update=update)
        cell.mb_in_flight = None
        now = self.clock()
        stats = rep.stats if rep.ok else {}
        self.emit(MicroBatchDone(t, now, cell.id, mid, step, rep.ok, stats))
        if rep.ok:
            self.core.microbatch_trained(mid)
            cell.step_mbs.add(mid)
        else:  # its trainer died: this micro-batch and the ones it held go back to the queue
            self.requeue(cell, (set(rep.lost) & cell.step_mbs) | {mid})

    def requeue(self, cell: Cell, lost: set[int]) -> None:
        cell.step_mbs.difference_update(lost)
        self.core.microbatches_lost(sorted(lost))

    @staticmethod
    def lost_at_prepare(cell: Cell, rep: PrepareReduceReply) -> set[int]:
        """Micro-batches whose gradients this cell no longer holds. The agent reports every
        micro-batch it lost in the step, again at each prepare_reduce; one already requeued (and
        trained again, maybe on another cell) must not be requeued again, or the step never
        ends and its gradient would count twice. So what it says it *holds* decides."""
        if rep.ok:
            return cell.step_mbs - set(rep.mb_ids)
        return set(rep.lost) & cell.step_mbs

    # ---- the step's reduce ---------------------------------------------------------------------
    async def reduce(self, index: int) -> StepReduced | None | str:
        """Prepare and reduce the open update of step ``index`` over every cell that holds its
        gradients (without minibatches: the step's only update).

        Returns `StepReduced` when every participant applied it (``final``: the step is done; else
        the next part trains, `update_applied`); None when it must be tried again (no trainer yet,
        or gradients were lost and are recomputed: the next tick retries); a message when the
        reduce failed after some cell may have applied it (replicas may now disagree: the run
        stops)."""
        update, final = self.core.step.update, self.core.step.final
        cells = [c for c in self.fleet if c.role is not Role.FAILED and (c.step_mbs or c.role is Role.TRAIN)]
        if not any(c.role is Role.TRAIN for c in cells):
            return None  # no trainer to apply the step: wait for the policy to bring one
        reps = await asyncio.gather(*(self.fleet.prepare_reduce(c, index, update) for c in cells))
        lost = False
        for c, r in zip(cells, reps):
            gone = self.lost_at_prepare(c, r)
            if gone or not r.ok:
                self.requeue(c, gone)
                lost = True
        if lost:
            return None  # lost gradients are recomputed; the next tick finishes the step again
        leader = min((c for c in cells if c.role is Role.TRAIN), key=lambda c: c.id)
        t = self.clock()
        reps = await asyncio.gather(*(self.fleet.reduce(c, index, cells, leader, update, final) for c in cells))
        bad = [f"cell {r.cell}: {r.error.splitlines()[0] if r.error else 'failed'}" for r in reps if not r.ok]
        if bad and all(r.ok or r.retry for r in reps):
            # no cell applied the step (a trainer died before the commit): hand the lost
            # micro-batches out again; the next tick reduces again
            for c, r in zip(cells, reps):
                self.requeue(c, set(r.lost) & c.step_mbs)
            self.notice("reduce_retry", {"step": index, "why": bad})
            return None
        if bad:
            return f"step {index}: reduce failed: {'; '.join(bad)}"
        red = StepReduced(cells, list(reps), self.clock() - t, final)
        self.updates.append(red)
        if not final:
            return red
        ups, self.updates = self.updates, []
        ids = sorted({c.id: c for u in ups for c in u.participants}.items())
        return StepReduced([c for _, c in ids], red.replies, sum(u.seconds for u in ups), True,
                           [u.grad_norm for u in ups])

    def update_applied(self, red: StepReduced) -> None:
        """An update inside the step is applied everywhere: its gradients are gone from the cells
        (what they report lost from here on is the next part's), the next part queues."""
        done = set(self.core.step.parts[self.core.step.update])
        for c in red.participants:
            c.step_mbs.difference_update(done)
        self.core.update_applied()

    def step_figures(self, stats: list[dict], replaced: int, groups: int,
                     microbatches=(), step: int | None = None) -> tuple[dict, dict, Audit]:
        """(the step row's driver figures, the merged mismatch summary, the token-identity audit)
        of a step's micro-batches: train/inference mismatch, replaced groups, trained tokens that
        differ from what the engine returned; the row itself (and every trainer mean in it) is
        built by `gyre.events.step_row`."""
        merged = merge(stats, parallel=False)
        mismatch = summarize(merged)
        audit = Audit()
        for m in microbatches:
            audit.add(self.audits.get(m, Audit()))
        extra = {  # the trainer's means (ratio, clip, entropy, loss per target) are the row builder's
            # the rate the trainers applied to step `step` (0-based; gyre.train.lr_schedule)
            "learning_rate": self.cfg.train.lr if step is None else
            LrSchedule.from_config(trainer_config(self.cfg)).lr_at(step + 1),
            "replaced_zero_variance": replaced,
            "replaced_share": replaced / (replaced + groups) if groups else 0.0,
            "audit_tokens": audit.tokens, "audit_mismatched_tokens": audit.mismatched,
            "audit_unchecked_tokens": audit.unchecked, "audit_first_offender": audit.first,
            **mismatch}
        if merged.get("kl_ref") is not None:  # train.kl_coef > 0: the penalty's estimate, its forward's share
            extra["kl_ref_mean"] = merged["kl_ref"]
            extra["ref_memory_bytes"] = merged.get("ref_bytes_max")  # per trainer rank
            extra["ref_time_fraction"] = merged.get("ref_time_sum", 0.0) / merged["fwd_bwd_s"] \
                if merged.get("fwd_bwd_s") else None
        return extra, mismatch, audit

    def step_closed(self, microbatches) -> None:
        """The step is written down: its payloads go (the next step may already be training)."""
        for c in self.fleet:
            c.step_mbs.difference_update(microbatches)
        for m in microbatches:
            self.batches.pop(m, None)
            self.audits.pop(m, None)
            self.prox.pop(m, None)
            self.scale.pop(m, None)
