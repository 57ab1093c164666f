"""Discrete-event simulator that drives a ``gyre.sched`` policy and the coordinator core, unchanged.

The lifecycle of groups and steps (states, admission under the staleness rule, replacement of
dropped groups, bursts of ``steps_per_sync`` optimizer steps per rollout round, lags in steps and
syncs, the ClusterState a policy sees) is ``gyre.sched.core.Coordinator``'s, the same object the
live head drives; this module only models time: decoding, environment time, evaluation,
training, switches, optimizer steps and weight pushes.

Events: execution start and end, model calls and tool time inside an execution (grouped into
segments of calls), evaluation, training (streamed: admitted work drains at the rate of the
training cells), role switches, weight pushes, and a periodic tick so a policy can revise its
estimates. Decoding is a fluid pool over the rollout cells' replicas: every call in flight gains
``ClusterModel.token_rate(calls in flight, serving cells, their mean context)`` tokens per second
(the roofline of gyre/sim/roofline.py), tracked with one virtual clock in tokens so a change of
load costs O(1) instead of touching every call. A call's prefill (its new tokens, or its whole
context after its prefix was evicted) is compute-bound and delays the call by its FLOP time
before it joins the decode pool (its replica's compute, which memory-bound decoding leaves idle).

What happened is told as `gyre.events` (the live head's events, on the simulated clock): run
start and end, role changes, execution start, evaluation and drops, group drops, weight pushes
and step ends. Decode and training are fluid pools with no per-cell call or micro-batch, so busy
time is told per stretch (`CellBusy`: a cell busy in its role from one change of the busy set to
the next) instead of one `CallRecorded` / `MicroBatchDone` each. Step rows, lags and per-cell time
are `gyre.events.RunStats`'s, as in a live run's report.

Prefix cache: each running execution is homed on one rollout cell, whose KV holds its context
between its calls while the cell's capacity allows (gyre/sim/prefix_cache.py). The run's
diagnostics, busy stretches and result are gyre/sim/diagnostics.py's.
"""

from __future__ import annotations

import heapq
import itertools
from heapq import heappush
import math
import random
import time
from dataclasses import dataclass, replace
from typing import Callable

from gyre.config import ConfigError
from gyre.events import (CellRoleChanged, Event, ExecutionDropped, ExecutionEvaluated, ExecutionStarted, GroupDropped,
                         GroupLag, RunEnded, RunStarted, RunStats, StepEnded, WeightsPushed)
from gyre.sched.core import ZERO_VARIANCE
from gyre.sched.runspec import RunSpec
from gyre.sched.state import CellView, ClusterState, Decision, Role
from gyre.sim.cost_model import ClusterModel
from gyre.sim.diagnostics import BusyStretches, Diagnostics, sim_result
from gyre.sim.decode_pool import DecodePool
from gyre.sim.prefix_cache import PrefixCache
from gyre.sim.result import SimResult
# the run loop, its kinds of event and its failure (SimError)
from gyre.sim.run_loop import (ENV as _ENV, EPS as _EPS, EVAL as _EVAL, OPT as _OPT, PREFILL as _PREFILL,
                               PUSH as _PUSH, SWITCH as _SWITCH, TICK as _TICK, SimError, run_events)
from gyre.sim.workload import Workload


@dataclass
class SimSpec:
    """What only a simulation has; the run itself (steps, staleness, bursts, the zero-variance rule,
    the policy) is the `RunSpec` a live run of the same configuration uses."""
    segments: int = 8          # model-call/environment segments per execution
    tick_s: float = 300.0      # policy re-evaluation period when nothing else happens
    record: bool = True        # keep the idle spans of each cell (the Gantt chart's shading)
    # the workload has no reward model, so the share of groups whose executions all score alike
    # is a parameter (measured live: benchmarks/results/learning.json,
    # replaced_zero_variance_share); 0 = none. The core's rule decides what happens to them.
    zero_variance_share: float = 0.0
    # The router's spread of executions over the engines (calls per endpoint a live run measured,
    # any positive numbers; their order does not matter). Empty = the pooled decode of
    # gyre/sim/cost_model.py (calls spread evenly at every instant). Given, each execution is kept
    # on one of L = len(router_spread) lanes (as affinity keeps it on one engine), chosen so the
    # running executions follow the shares, and each lane is 1/L of the serving replicas: its
    # calls decode at the batch its own calls in flight make there. Identical executions on an
    # even spread give the pooled figures.
    router_spread: tuple = ()

    def __post_init__(self) -> None:
        self.router_spread = tuple(float(x) for x in self.router_spread)
        if any(not math.isfinite(x) or x <= 0 for x in self.router_spread):
            raise ConfigError(f"router_spread must hold positive shares (calls per endpoint), got "
                              f"{list(self.router_spread)}; leave out endpoints that served no call")
        if self.segments < 1:
            raise ConfigError(f"segments must be >= 1, got {self.segments}")
        if self.tick_s <= 0:
            raise ConfigError(f"tick_s must be positive, got {self.tick_s}")
        if not 0.0 <= self.zero_variance_share <= 1.0:
            raise ConfigError(f"zero_variance_share must be within [0, 1], got {self.zero_variance_share}")


class _Exec:
    __slots__ = ("id", "group", "version", "started_at", "seg", "env_seg", "out_seg", "pre_seg",
                 "calls_seg", "calls_done", "in_call", "spec", "home", "call_seq", "cached", "ctx_mid", "lane")

    def __init__(self, eid, group, version, now, spec, segments):
        self.id, self.group, self.version, self.started_at, self.spec = eid, group, version, now, spec
        self.seg = 0
        self.env_seg = spec.tool_s / segments
        self.out_seg = spec.output_tokens / segments
        self.pre_seg = spec.prefill_tokens / segments
        self.calls_seg = spec.calls / segments
        self.calls_done = 0.0
        self.in_call = False
        self.home = -1        # rollout cell holding its KV/prefix cache; -1 = none
        self.call_seq = -1    # identifies its call's entry in the decode heap
        self.cached = 0.0     # tokens of its context whose KV its home cell holds
        self.ctx_mid = 0.0    # mean context of its call in flight (KV read per decode step)
        self.lane = 0         # its lane of the decode pool (SimSpec.router_spread)


class _Group:
    """The simulator's side of a group: its workload and timing. Its lifecycle (states, version,
    admission, lags) belongs to the coordinator core's GroupRecord of the same id."""
    __slots__ = ("id", "spec", "left", "exec_ids", "slowest")

    def __init__(self, gid, spec):
        self.id, self.spec = gid, spec
        self.left = len(spec.execs)  # executions not yet ended
        self.exec_ids: list[int] = []
        self.slowest = 0.0  # wall time of its slowest execution so far


class Simulator:
    # slots: the run loop and its handlers read these at every event, and CPython reads a slot
    # faster than an entry of a 70-attribute instance dict
    __slots__ = ('spec', 'w', 'c', 's', 'p', 'on_event', 'core', 'role', 'since', 'now', 'events', 'seq',
                 'n_events', 'decisions', 'pool', 'push_until', 'opt_until', 'running', 'groups', 'next_exec',
                 'outcomes', 'awaiting_eval', 'mb_queue', 'train_left', 'trained_by_step', 'last_step_end',
                 'n_rollout', 'n_train', 'roles_rev', '_n_cells', '_segments', '_reps', '_tps', '_cells_rev',
                 '_cells_v', '_maybe_ready', 'stats', 'cache', 'diag', 'busy', '_budget_only')

    def __init__(self, spec: RunSpec, workload: Workload, cluster: ClusterModel, sim: SimSpec | None = None,
                 on_event: Callable[[Event], object] | None = None) -> None:
        """`spec` is the run (the live head builds its own from the same `RunSpec.from_config`);
        `on_event` is told every event after RunStats (a metrics sink, a test)."""
        if spec.core.group_size != workload.group_size:
            raise ConfigError(f"the run has groups of {spec.core.group_size} executions (harness.group_size) "
                              f"but the workload {workload.name!r} has {workload.group_size}; make them agree")
        if spec.core.minibatches > 1:  # modelled as one pass per step: the extra updates' reduces and
            # pi_prox forwards are small beside a step's training tokens (train.minibatches_per_step)
            spec = replace(spec, core=replace(spec.core, minibatches=1, prox=False))
        self.spec, self.w, self.c, self.s = spec, workload, cluster, sim or SimSpec()
        self.p = policy = spec.policy()
        self.on_event = on_event
        n = cluster.cells
        roles = policy.initial_roles(n)
        if len(roles) != n:
            raise ConfigError(f"{policy.label}: initial_roles gave {len(roles)} roles for {n} cells")
        self.core = spec.coordinator(policy)
        self.role = list(roles)
        self.since = [0.0] * n
        self.now = 0.0
        self.events: list = []
        self.seq = itertools.count()
        self.n_events = 0
        self.decisions = 0
        # the policy declares it only starts the start budget: ask the core for the budget, not the
        # policy (bit-identical: the state's start_budget is the core's; the core here never has
        # minibatches > 1, whose step_ready in cluster_state would split the step as a side effect)
        self._budget_only = policy.starts_budget_only
        # decode pool: one lane per share of the router's spread (one lane: an even spread)
        self.pool = DecodePool(cluster.token_rate_fn(), self.s.router_spread, self.seq)
        self.push_until = 0.0
        self.opt_until = 0.0
        # executions and groups
        self.running: dict[int, _Exec] = {}
        self.groups: dict[int, _Group] = {}
        self.next_exec = 0
        self.outcomes: dict[int, tuple] = {}
        self.awaiting_eval = 0
        self.mb_queue: list = []   # (micro-batch id, tokens left) of the open step, in core order
        self.train_left = 0.0      # tokens of the open step not yet trained (fluid)
        self.trained_by_step: list[list[int]] = []
        self.last_step_end = 0.0
        # accounting
        self.n_rollout = sum(1 for r in roles if r is Role.ROLLOUT)
        self.n_train = sum(1 for r in roles if r is Role.TRAIN)
        self.roles_rev = 0
        self._n_cells = cluster.cells
        self._segments = self.s.segments
        self.cache = PrefixCache(self.role, cluster.kv_tokens_per_cell, cluster.replica.prefill_fn())
        # per-event arithmetic with the cluster's constants bound once (the same floats)
        self._reps = cluster.replicas
        self._tps = cluster.train_tokens_per_s
        self._cells_rev = -1         # roles_rev of _cells_v, the cells as a policy sees them
        self._cells_v: tuple = ()
        # the open step may have become ready (work assigned or trained, a step ended): only then
        # is the core asked (step_ready), not after every event
        self._maybe_ready = True
        self.diag = Diagnostics(workload, cluster)
        # what happened, told once (gyre.events); every figure of a cell's time comes from here
        self.stats = RunStats(0.0, n)
        self.busy = BusyStretches(self.role, self._emit)
        self._emit(RunStarted(0.0, n))
        for i, r in enumerate(roles):
            self._emit(CellRoleChanged(0.0, i, r.value))
        self._push(self.s.tick_s, _TICK, None)

    def _emit(self, ev: Event) -> None:
        self.stats.apply(ev)
        if self.on_event is not None:
            self.on_event(ev)

    # ---- event plumbing -------------------------------------------------------------------
    def _push(self, t: float, kind: int, obj) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, obj))

    def _serving(self) -> int:
        return 0 if self.now < self.push_until - _EPS else self.n_rollout

    def _train_rate(self) -> float:
        return self.n_train * self._tps  # ClusterModel.train_rate

    def _drain(self, tokens: float) -> None:
        """Training streams the open step's micro-batches (one per execution) in queue order; each
        one finished is reported to the core as the live trainers report theirs."""
        self.train_left -= tokens
        while self.mb_queue and tokens > 0:
            mb, rem = self.mb_queue[0]
            if rem > tokens + 1e-3:  # float residue of a finished drain is not work
                self.mb_queue[0] = (mb, rem - tokens)
                return
            tokens -= rem
            self.mb_queue.pop(0)
            got = self.core.next_microbatch()
            if got != mb:
                raise SimError(f"core handed micro-batch {got!r}, the simulator trained {mb!r}")
            self.core.microbatch_trained(mb)
            self._maybe_ready = True
        if not self.mb_queue:
            self.train_left = 0.0

    # ---- executions -----------------------------------------------------------------------
    def _start_group(self, rec) -> None:
        g = _Group(rec.id, self.w.group(rec.id))
        self.groups[rec.id] = g
        # Its version: the oldest weights that serve one of its calls. Decoding pauses during a
        # weight push, so an execution started then is first served by the version being pushed.
        version = self.core.version if self.now < self.push_until - _EPS else self.core.rollout_version
        for spec in g.spec.execs:
            e = _Exec(self.next_exec, g, version, self.now, spec, self.s.segments)
            self.pool.assign_lane(e)
            self.next_exec += 1
            g.exec_ids.append(e.id)
            self.running[e.id] = e
            self.core.execution_started(rec.id, e.id, self.now)
            self._emit(ExecutionStarted(self.now, str(e.id), rec.id))
            self._begin_call(e)  # homes it (nothing cached yet)

    def _begin_call(self, e: _Exec) -> None:
        """A call starts: prefill its new tokens (and its whole context if its prefix is gone),
        then decode its output in the shared pool."""
        e.in_call = True
        self.core.call_started(e.id)
        seg, n = e.seg, self._segments
        ctx = e.spec.context_tokens
        before = ctx * seg / n
        after = ctx * (seg + 1) / n
        prefill = self.cache.call_begins(e, before, after)  # homes it, holds its context to `after`
        e.ctx_mid = (before + after) / 2
        if prefill > 0:  # a weight push pauses prefill as it pauses decoding
            now, until = self.now, self.push_until
            heappush(self.events, ((now if now >= until else until) + prefill, next(self.seq), _PREFILL, e))
        else:
            self.pool.add(e)

    def _evict(self, cell: int) -> None:
        """A cell leaves rollout: its executions lose their KV cache and move on (PrefixCache.evict);
        their calls in flight are retried elsewhere and re-prefill their context."""
        homed = self.cache.evict(cell)
        moved = False
        rate: tuple = ()
        at = None  # (lane, heap position) of each call in flight, built once (not a scan per execution)
        pool = self.pool
        prefill, lanes, segments = self.cache.prefill, pool.lanes, self._segments
        for e in homed:
            if not e.in_call:
                continue
            cost = prefill(e.ctx_mid)  # ClusterModel.prefill_s
            if cost <= 0:
                continue
            # no cell serves now (a whole-pool switch) or no call is decoding yet: price the
            # re-prefill at one replica's rate for the calls in flight (at least this one)
            n = max(pool.in_call, 1)
            rate = rate or pool.speed(self._serving())
            lane_rate = rate[e.lane] or self.c.token_rate(n, 1, pool.ctx_sum / n)
            if at is None:  # only the entries of this cell's calls are looked for
                wanted = {x.call_seq for x in homed if x.in_call}
                at = {item[1]: (k, j) for k, calls in enumerate(lanes)
                      for j, item in enumerate(calls) if item[1] in wanted}
            kj = at.get(e.call_seq)
            if kj is not None:  # decoding (a call still prefilling pays at its next call)
                k, j = kj
                v, sq, x = lanes[k][j]
                lanes[k][j] = (v + cost * lane_rate, sq, x)
                moved = True
                self.cache.rebuilt(e, e.spec.context_tokens * (e.seg + 1) / segments)
        if moved:
            for calls in lanes:
                heapq.heapify(calls)

    def _end_call(self, e: _Exec) -> None:
        e.in_call = False
        self.core.call_ended(e.id, e.calls_seg)
        self.pool.remove(e)
        e.calls_done += e.calls_seg
        if e.home >= 0:
            try:
                self.cache.lru[e.home].move_to_end(e.id)  # most recently used
            except KeyError:  # it holds no prefix there (evicted)
                pass
        heappush(self.events, (self.now + e.env_seg, next(self.seq), _ENV, e))

    def _end_env(self, e: _Exec) -> bool:
        """Next segment, or the execution ends (True)."""
        e.seg += 1
        if e.seg < self._segments:
            self._begin_call(e)
            return False
        del self.running[e.id]
        self.pool.running[e.lane] -= 1
        self.cache.unhome(e)  # a finished execution's prefix is never used again
        took = self.now - e.started_at
        self.diag.execution_ended(took, e.spec.tool_s)
        e.group.slowest = max(e.group.slowest, took)
        e.group.left -= 1
        self.core.execution_ended(e.id, self.now)
        self.awaiting_eval += 1
        self._push(self.now + self.c.eval_s, _EVAL, e)
        return True

    def _evaluated(self, e: _Exec) -> None:
        self.awaiting_eval -= 1
        reward = self._reward(e)
        adm = self.core.execution_evaluated(e.id, self.now, version=e.version, tokens=e.spec.train_tokens,
                                            reward=reward)
        self._emit(ExecutionEvaluated(self.now, str(e.id), e.group.id, "finished", reward, e.version,
                                      e.spec.train_tokens, True))
        self._admitted(adm)

    def _reward(self, e: _Exec) -> float:
        """A group scores alike (all 0) with probability zero_variance_share, seeded by its id;
        otherwise its members alternate 0/1. Only the spread matters to the core's rule."""
        g = e.group
        share = self.s.zero_variance_share
        if share > 0 and random.Random(g.id).random() < share:  # random() is never below 0
            return 0.0
        return float(g.exec_ids.index(e.id) % 2)

    def _admitted(self, adm) -> None:
        """Assigned groups become the open step's training work (one fluid batch per group);
        dropped ones are recorded as not admitted (the core replaces them with new starts)."""
        self._maybe_ready = True
        for g in adm.assigned:
            mbs = {("e", eid): self.groups[g.id].spec.execs[j].train_tokens
                   for j, eid in enumerate(self.groups[g.id].exec_ids)}
            self.core.microbatches_added(g.id, mbs)
            self.mb_queue.extend(mbs.items())
            self.train_left += sum(mbs.values())
        if self.diag.win_open and len(self.core.step.groups) >= self.core.spec.groups_per_step:
            # the step's batch is complete: its rollout window closes
            self.diag.batch_complete(sum(self.core.step.work.values()) / self.c.train_rate(1))  # cell-seconds
        for g in adm.dropped:
            why = ZERO_VARIANCE if g.reason == ZERO_VARIANCE else "stale"
            if why == "stale":  # expired (and replaced); zero-variance drops count per execution
                self._emit(GroupDropped(self.now, g.id, why))
            for eid in self.groups[g.id].exec_ids:
                self._drop(eid, g.id, why)

    def _drop(self, eid: int, group: int, why: str) -> None:
        self.outcomes[eid] = ("not_admitted", why)
        self._emit(ExecutionDropped(self.now, str(eid), group, why))

    # ---- training steps -------------------------------------------------------------------
    def _step_end(self) -> None:
        res = self.core.step_ended(self.now)
        gs = res.groups
        push = res.push_due and not self.core.done
        push_s = self.c.push_s if push else 0.0
        self._emit(StepEnded(
            self.last_step_end, self.now, res.index, res.version,
            tuple(GroupLag(g.id, g.version, g.lag_steps, g.lag_syncs, g.train_tokens) for g in gs),
            tuple(res.microbatches), tuple(i for i, r in enumerate(self.role) if r is Role.TRAIN),
            res.push_due, self.c.opt_s, push_s))
        self.last_step_end = self.now
        self.trained_by_step.append([g.id for g in gs])
        self.diag.step_ended()
        for g in gs:
            for eid in self.groups[g.id].exec_ids:
                self.outcomes[eid] = ("trained", res.index)
        self._admitted(res.admission)
        if push:
            if push_s > 0:  # weight push: rollout cells pause, then serve the new version
                self.push_until = self.now + push_s
                self._push(self.push_until, _PUSH, None)
                self._emit(WeightsPushed(self.now, self.push_until, res.version))
            else:
                self.core.weights_pushed(self.core.version)

    # ---- policy ---------------------------------------------------------------------------
    def _state(self) -> ClusterState:
        if self._cells_rev != self.roles_rev:  # views change only with a role
            self._cells_v = tuple(CellView(i, r, self.since[i]) for i, r in enumerate(self.role))
            self._cells_rev = self.roles_rev
        return self.core.cluster_state(self.now, self._cells_v)

    def _decide(self) -> None:
        """Ask the policy (one decision, counted) and carry its decision out."""
        self.decisions += 1
        if self._budget_only:
            core = self.core
            n = 0 if core.done else core.start_budget()  # = start_budget(cluster_state(...))
            if n > 0:
                for rec in core.start_groups(n, self.now):
                    self._start_group(rec)
            return
        self._apply(self.p.decide(self._state(), self.now))

    def _apply(self, d: Decision) -> None:
        for sw in d.switches:
            i = sw.cell
            if not 0 <= i < len(self.role):
                raise SimError(f"{self.p.label}: switch of unknown cell {i}")
            cur = self.role[i]
            if not cur.settled or cur is sw.to or sw.to not in (Role.ROLLOUT, Role.TRAIN):
                raise SimError(f"{self.p.label}: cannot switch cell {i} from {cur.value} to {sw.to.value}")
            to_train = sw.to is Role.TRAIN
            self._set_role(i, Role.TO_TRAIN if to_train else Role.TO_ROLLOUT)
            if to_train:
                self._evict(i)
            self._push(self.now + (self.c.to_train_s if to_train else self.c.to_rollout_s), _SWITCH, i)
        if d.start_groups > 0:
            for rec in self.core.start_groups(d.start_groups, self.now):
                self._start_group(rec)

    def _set_role(self, i: int, role: Role) -> None:
        self._emit(CellRoleChanged(self.now, i, role.value))
        self.n_rollout += (role is Role.ROLLOUT) - (self.role[i] is Role.ROLLOUT)
        self.n_train += (role is Role.TRAIN) - (self.role[i] is Role.TRAIN)
        self.roles_rev += 1
        self.role[i] = role
        self.cache.roles_changed()
        self.since[i] = self.now

    # ---- main loop ------------------------------------------------------------------------
    def run(self, give_up_after: float = math.inf) -> SimResult:
        """Simulate to the last step; with `give_up_after`, raise GaveUp once the next event lies
        past it (the makespan would be longer). The loop is gyre.sim.run_loop's."""
        wall = time.perf_counter()
        self._decide()
        run_events(self, give_up_after)
        return self._result(time.perf_counter() - wall)

    def _event(self, kind: int, obj) -> None:
        """An evaluation, a switch's end, an optimizer step's end or a weight push's end."""
        if kind == _EVAL:
            self._evaluated(obj)
        elif kind == _SWITCH:
            self._set_role(obj, Role.TRAIN if self.role[obj] is Role.TO_TRAIN else Role.ROLLOUT)
            if self.role[obj] is Role.ROLLOUT:
                for e in self.running.values():
                    if e.home < 0:
                        self.cache.home(e)
        elif kind == _OPT:
            self.opt_until = 0.0
            self._step_end()
        elif kind == _PUSH:
            self.push_until = 0.0
            self.core.weights_pushed(self.core.version)

    def _ready(self) -> None:
        """The open step's batch is complete and trained: its optimizer step runs."""
        self.core.step_ending(self.now)
        if self.c.opt_s > 0:  # the optimizer step; the version moves on after it
            self.opt_until = self.now + self.c.opt_s
            self._push(self.opt_until, _OPT, None)
        else:
            self._step_end()

    def _result(self, wall: float) -> SimResult:
        """The run ended: what never finished is dropped (`run_ended`), the open busy stretches
        and the run's end are told; the figures are gyre.sim.diagnostics.sim_result's."""
        end = self.now
        ended = {e.id: e.group.id for e in self.running.values()}
        for rec in self.core.unfinished():
            ended.update(dict.fromkeys(self.groups[rec.id].exec_ids, rec.id))
        for eid, gid in ended.items():
            self._drop(eid, gid, "run_ended")
        self.busy.close(end)
        self._emit(RunEnded(end))
        return sim_result(self, wall)


def simulate(spec: RunSpec, workload: Workload, cluster: ClusterModel, sim: SimSpec | None = None,
             on_event: Callable[[Event], object] | None = None, give_up_after: float = math.inf) -> SimResult:
    return Simulator(spec, workload, cluster, sim, on_event).run(give_up_after)
