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

Prefix cache: each running execution is homed on one rollout cell (the router's choice); the KV
of its context stays there between its calls while the cell's capacity (replicas x HBM left after
weights) allows. When it overflows, the least recently used idle executions lose their prefix
(an eviction) and their next call re-prefills the whole context; a cell leaving rollout loses all
of its prefixes.
"""

from __future__ import annotations

import heapq
import itertools
from heapq import heappop, heappush
import math
import random
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, replace
from typing import Callable

from gyre.config import ConfigError, StalenessRule
from gyre.events import (ROLLOUT, TRAIN, CellBusy, CellRoleChanged, Event, ExecutionDropped, ExecutionEvaluated,
                         ExecutionStarted, GroupDropped, GroupLag, RunEnded, RunStarted, RunStats, StepEnded,
                         WeightsPushed)
from gyre.sched.core import ZERO_VARIANCE
from gyre.sched.runspec import RunSpec
from gyre.sched.state import CellView, ClusterState, Decision, Role
from gyre.sim.bound import lower_bound_trained
from gyre.sim.cost_model import ClusterModel
from gyre.sim.result import SimResult
from gyre.sim.workload import Workload

_EPS = 1e-9
_ENV, _EVAL, _SWITCH, _PUSH, _TICK, _OPT, _PREFILL = range(7)


class SimError(RuntimeError):
    """The simulation cannot make progress (a policy that never trains, a deadlock)."""


class GaveUp(Exception):
    """The run was stopped once its clock passed `give_up_after`: its makespan is longer (a search
    that already has a run that fast does not need the rest of this one)."""

    def __init__(self, at: float) -> None:
        super().__init__(f"given up at {at:.0f} s")
        self.at = at


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
                 'n_events', 'decisions', 'lane_share', 'lane_running', 'lane_calls', 'lane_ctx', 'vclocks',
                 'lanes', 'in_call', 'push_until', 'opt_until', 'running', 'groups', 'next_exec', 'outcomes',
                 'awaiting_eval', 'mb_queue', 'train_left', 'trained_by_step', 'last_step_end', 'n_rollout',
                 'n_train', 'roles_rev', '_assign_cache', '_busy_key', '_n_cells', '_segments', 'homed',
                 'n_homed', '_rollout_rev', '_rollout_ids', 'lru', 'kv_used', 'kv_cap', '_rate', '_reps',
                 '_tps', '_prefill', '_cells_rev', '_cells_v', '_maybe_ready', '_speed_key', '_speed_v',
                 'evictions', 'reprefills', 'ctx_sum', 'tool_time', 'knee', 'win_spare', 'win_open',
                 'slacks', 'unserved', 'exec_time', 'execs_ended', 'crit_roll', 'load_num', 'load_den',
                 'stats', 'busy_a', 'busy_since', '_budget_only')

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
        # decode pool: one lane per share of the router's spread (one lane: an even spread), each
        # with its virtual clock in tokens and its heap of calls (virtual finish, seq, exec)
        spread = self.s.router_spread or (1.0,)
        self.lane_share = tuple(x / sum(spread) for x in spread)
        self.lane_running = [0] * len(spread)  # running executions per lane
        self.lane_calls = [0] * len(spread)    # calls decoding per lane
        self.lane_ctx = [0.0] * len(spread)    # their mean-context numerator
        self.vclocks = [0.0] * len(spread)
        self.lanes: list[list] = [[] for _ in spread]
        self.in_call = 0
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
        self._assign_cache: dict = {}
        self._busy_key: tuple | None = None  # (roles_rev, busy rollout cells, pushing, training) of busy_a
        self._n_cells = cluster.cells
        self._segments = self.s.segments
        self.homed: list[dict] = [{} for _ in range(n)]  # per cell: the executions it serves
        self.n_homed = [0] * n     # their number (the router's load)
        self._rollout_rev = -1     # roles_rev of _rollout_ids, the settled rollout cells in order
        self._rollout_ids: list[int] = []
        self.lru: list[OrderedDict] = [OrderedDict() for _ in range(n)]  # per cell: those holding a prefix
        self.kv_used = [0.0] * n   # tokens of KV held per cell
        self.kv_cap = cluster.kv_tokens_per_cell
        # per-event arithmetic with the cluster's constants bound once (the same floats)
        self._rate = cluster.token_rate_fn()
        self._reps = cluster.replicas
        self._tps = cluster.train_tokens_per_s
        self._prefill = cluster.replica.prefill_fn()
        self._cells_rev = -1         # roles_rev of _cells_v, the cells as a policy sees them
        self._cells_v: tuple = ()
        # the open step may have become ready (work assigned or trained, a step ended): only then
        # is the core asked (step_ready), not after every event
        self._maybe_ready = True
        self._speed_key: tuple = ()  # (calls in flight, serving cells, context sum) of _speed_v
        self._speed_v: tuple = (0.0,) * len(self.lanes)
        self.evictions = 0         # prefixes evicted for capacity
        self.reprefills = 0        # calls that re-prefilled a lost context (eviction or cell switch)
        self.ctx_sum = 0.0         # mean-context numerator of the calls in flight
        self.tool_time = 0.0       # tool seconds of ended executions
        # slack: per step, the share of the rollout side's spare capacity during the step's rollout
        # window (step start -> batch complete) that the step's training does not need; spare =
        # cells the calls in flight do not need at the decode knee (ClusterModel.calls_per_cell)
        ctx = [e.context_tokens / 2 for i in range(4) for e in workload.group(i).execs]
        self.knee = cluster.calls_per_cell(sum(ctx) / len(ctx)) if ctx else 1.0
        self.win_spare = 0.0
        self.win_open = True
        self.slacks: list[float] = []
        self.unserved = 0.0
        self.exec_time = 0.0  # wall seconds of ended executions (their observed durations)
        self.execs_ended = 0
        # regime diagnostics
        self.crit_roll = 0.0         # rollout on the critical path
        self.load_num = self.load_den = 0.0  # call-weighted load per serving cell
        # what happened, told once (gyre.events); every figure of a cell's time comes from here
        self.stats = RunStats(0.0, n)
        self.busy_a: tuple[int, ...] | None = None  # the bucket of every cell since the last change
        self.busy_since = [0.0] * n                 # start of a cell's open busy stretch
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

    def _speed(self) -> tuple:
        """Tokens per second each call in flight gains now, per lane (kept until the load, the
        serving cells or the mean context change). The run loop keeps its own copy of this cache;
        this one serves the rarer askers (an evicted cell's re-prefill)."""
        n, cs = self.in_call, self.ctx_sum
        serving = 0 if self.now < self.push_until - _EPS else self.n_rollout
        key = (n, serving, cs) if len(self.lanes) == 1 else (n, serving, cs, tuple(self.lane_calls))
        if key != self._speed_key:
            self._speed_key = key
            self._speed_v = (self._rate(n, serving, cs / n if n else 0.0),) if len(self.lanes) == 1 else \
                self._lane_speeds(serving)
        return self._speed_v

    def _lane_speeds(self, serving: int) -> tuple:
        """Per lane (SimSpec.router_spread): a lane is 1/L of the serving replicas, loaded by its
        own calls in flight."""
        lanes, rate = len(self.lanes), self._rate
        return tuple(rate(k * lanes, serving, c / k) if k else 0.0 for k, c in zip(self.lane_calls, self.lane_ctx))

    def _train_rate(self) -> float:
        return self.n_train * self._tps  # ClusterModel.train_rate

    def _assignment(self, busy_r: int, pushing: bool, training: bool) -> tuple[int, ...]:
        """Bucket index of every cell for this configuration (cached: few distinct ones occur)."""
        key = (self.roles_rev, busy_r, pushing, training)
        a = self._assign_cache.get(key)
        if a is None:
            out = []
            for r in self.role:
                if r is Role.ROLLOUT:
                    if pushing:
                        b = 2
                    elif busy_r > 0:
                        b, busy_r = 0, busy_r - 1
                    else:
                        b = 3
                elif r is Role.TRAIN:
                    b = 1 if training else 3
                elif r in (Role.TO_TRAIN, Role.TO_ROLLOUT):
                    b = 2
                else:
                    b = 3
                out.append(b)
            a = self._assign_cache[key] = tuple(out)
        return a

    def _busy_changed(self, a: tuple[int, ...]) -> None:
        """The busy set changed at now: a cell's busy stretch (bucket 0: serving calls, 1:
        training) that ends is told; one that begins is opened."""
        old, now = self.busy_a, self.now
        for i, b in enumerate(a):
            was = old[i] if old is not None else -1
            if b == was:
                continue
            if was == 0 or was == 1:
                self._emit(CellBusy(self.busy_since[i], now, i, ROLLOUT if was == 0 else TRAIN))
            if b == 0 or b == 1:
                self.busy_since[i] = now
        self.busy_a = a

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
            self._assign_lane(e)
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
        if e.cached <= 0:  # nothing cached to lose: the router sends it to the least-loaded cell
            self._unhome(e)
            self._home(e)
        prefill = self._prefill(e.pre_seg, before)
        cached = e.cached
        if seg > 0 and cached < before - 1e-6:  # its prefix was evicted or never rebuilt here
            prefill += self._prefill(before - cached, cached)
            self.reprefills += 1
        h = e.home
        if h >= 0:
            kv = self.kv_used
            kv[h] += after - cached
            e.cached = after
            lru = self.lru[h]
            lru[e.id] = e
            lru.move_to_end(e.id)
            if kv[h] > self.kv_cap:
                self._make_room(h)
        e.ctx_mid = (before + after) / 2
        if prefill > 0:  # a weight push pauses prefill as it pauses decoding
            now, until = self.now, self.push_until
            heappush(self.events, ((now if now >= until else until) + prefill, next(self.seq), _PREFILL, e))
        else:
            self._decode(e)

    def _decode(self, e: _Exec) -> None:
        """Its prefill done, a call decodes its output in the shared pool."""
        self.ctx_sum += e.ctx_mid
        self.in_call += 1
        self.lane_calls[e.lane] += 1
        self.lane_ctx[e.lane] += e.ctx_mid
        e.call_seq = sq = next(self.seq)  # identifies its entry in the decode heap
        heappush(self.lanes[e.lane], (self.vclocks[e.lane] + e.out_seg, sq, e))

    def _assign_lane(self, e: _Exec) -> None:
        """The lane furthest below its share of the running executions (the lowest index among
        equals): over a run the lanes carry the router's measured spread."""
        run, share = self.lane_running, self.lane_share
        total = sum(run) + 1
        e.lane = max(range(len(run)), key=lambda i: (share[i] * total - run[i], -i))
        run[e.lane] += 1

    def _make_room(self, cell: int) -> None:
        """LRU eviction of idle executions' prefixes until the cell's KV fits; calls in flight
        keep theirs (SGLang's radix cache never evicts a running request's KV)."""
        lru = self.lru[cell]
        while lru and self.kv_used[cell] > self.kv_cap:
            eid, x = next(iter(lru.items()))
            if x.in_call:  # the oldest holder is decoding: nothing idle is older; stop here
                break
            del lru[eid]  # an execution without a prefix is back in the order at its next call
            self.kv_used[cell] -= x.cached
            x.cached = 0.0
            self.evictions += 1

    def _rollout_cells(self) -> list[int]:
        """The settled rollout cells, in index order (kept until a role changes)."""
        if self._rollout_rev != self.roles_rev:
            self._rollout_ids = [i for i, r in enumerate(self.role) if r is Role.ROLLOUT]
            self._rollout_rev = self.roles_rev
        return self._rollout_ids

    def _home(self, e: _Exec) -> None:
        """Place an execution on the least-loaded settled rollout cell (the router's choice; the
        lowest index among equals)."""
        ids, n_homed = self._rollout_cells(), self.n_homed
        # min() keeps the first of equals: the lowest index, as a scan in cell order would
        best = min(ids, key=n_homed.__getitem__) if ids else -1
        e.home = best
        e.cached = 0.0
        if best >= 0:
            h = self.homed[best]
            h[e.id] = e
            n_homed[best] = len(h)

    def _unhome(self, e: _Exec) -> None:
        if e.home >= 0:
            h = self.homed[e.home]
            h.pop(e.id, None)
            self.n_homed[e.home] = len(h)
            self.kv_used[e.home] -= e.cached
            self.lru[e.home].pop(e.id, None)
        e.home = -1
        e.cached = 0.0

    def _evict(self, cell: int) -> None:
        """A cell leaves rollout: its executions keep their harness state but lose their KV cache;
        they move to other cells (or wait, if none serves) and re-prefill their context."""
        moved = False
        homed = list(self.homed[cell].values())
        self.homed[cell] = {}
        self.n_homed[cell] = 0
        self.kv_used[cell] = 0.0
        self.lru[cell].clear()
        rate: tuple = ()
        at = None  # (lane, heap position) of each call in flight, built once (not a scan per execution)
        prefill, lanes, segments, kv = self._prefill, self.lanes, self._segments, self.kv_used
        # each execution goes where _home would put it, one after another: the least-loaded
        # rollout cell, the lowest index among equals (a heap of (homed, index), not a scan each)
        n_homed, homes = self.n_homed, self.homed
        least = [(n_homed[i], i) for i in self._rollout_cells()]
        heapq.heapify(least)
        for e in homed:
            if least:
                best = least[0][1]
                h = homes[best]
                h[e.id] = e
                n_homed[best] = len(h)
                heapq.heapreplace(least, (len(h), best))
            else:
                best = -1
            e.home = best
            e.cached = 0.0
            if e.in_call:  # the call in flight is retried elsewhere and re-prefills its context
                cost = prefill(e.ctx_mid)  # ClusterModel.prefill_s
                if cost <= 0:
                    continue
                # no cell serves now (a whole-pool switch) or no call is decoding yet: price the
                # re-prefill at one replica's rate for the calls in flight (at least this one)
                n = max(self.in_call, 1)
                rate = rate or self._speed()
                lane_rate = rate[e.lane] or self.c.token_rate(n, 1, self.ctx_sum / n)
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
                    self.reprefills += 1
                    if e.home >= 0:  # the retry rebuilt its context on the new cell
                        e.cached = e.spec.context_tokens * (e.seg + 1) / segments
                        kv[e.home] += e.cached
        if moved:
            for calls in self.lanes:
                heapq.heapify(calls)

    def _end_call(self, e: _Exec) -> None:
        e.in_call = False
        self.core.call_ended(e.id, e.calls_seg)
        self.in_call -= 1
        if self.in_call:
            cs = self.ctx_sum - e.ctx_mid
            self.ctx_sum = cs if cs > 0.0 else 0.0  # max(0.0, ...): float residue
        else:
            self.ctx_sum = 0.0
        lane = e.lane
        k = self.lane_calls[lane] = self.lane_calls[lane] - 1
        if k:
            x = self.lane_ctx[lane] - e.ctx_mid
            self.lane_ctx[lane] = x if x > 0.0 else 0.0  # max(0.0, x)
        else:
            self.lane_ctx[lane] = 0.0
        e.calls_done += e.calls_seg
        if e.home >= 0:
            try:
                self.lru[e.home].move_to_end(e.id)  # most recently used
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
        self.lane_running[e.lane] -= 1
        self._unhome(e)  # a finished execution's prefix is never used again
        took = self.now - e.started_at
        self.exec_time += took
        self.tool_time += e.spec.tool_s
        self.execs_ended += 1
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
        if self.win_open and len(self.core.step.groups) >= self.core.spec.groups_per_step:
            # the step's batch is complete: its rollout window closes
            work = sum(self.core.step.work.values()) / self.c.train_rate(1)  # cell-seconds
            if self.win_spare > 0:
                self.slacks.append(1.0 - work / self.win_spare)
            self.win_open = False
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
        self.win_spare, self.win_open = 0.0, True
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
        self.since[i] = self.now

    # ---- main loop ------------------------------------------------------------------------
    def run(self, give_up_after: float = math.inf) -> SimResult:
        """Simulate to the last step; with `give_up_after`, raise GaveUp once the next event lies
        past it (the makespan would be longer).

        The loop runs once per event, so the decode speed, the next event's time, the advance of
        the clock to it (with the figures the loop already holds: the busy set, the run's
        diagnostics, the decode clocks and training's drain) and the events due are worked out
        inline; the rarer kinds of event go to `_event`."""
        wall = time.perf_counter()
        self._decide()
        idle_ticks = 0
        core, steps = self.core, self.core.spec.steps  # core.done: version >= steps
        rate_fn, lane_speeds, tps = self._rate, self._lane_speeds, self._tps
        end_call, decode, end_env, event, drain = self._end_call, self._decode, self._end_env, self._event, self._drain
        events, lanes, vclocks, lane_calls, mbq = self.events, self.lanes, self.vclocks, self.lane_calls, self.mb_queue
        one = len(lanes) == 1  # the pooled decode: one lane (the common case, kept short)
        calls0 = lanes[0]
        inf = math.inf
        n_cells, knee, reps = self._n_cells, self.knee, self._reps
        # the loop's own cache of the decode speed (`_speed`'s, without building its key per event)
        k_n, k_serving, k_cs, k_lanes, speed = -1, -1, -1.0, None, self._speed_v
        # `while True`: its unconditional back edge is where CPython 3.11 specializes a running
        # function's code (a `while cond` loop's conditional one is not; the loop once ran three
        # times the dictionary lookups per event for it)
        while True:
            if core.version >= steps:
                break
            # the decode speed per lane (_speed): nothing changes it between the next event's time
            # and the advance to it
            now, n, cs, n_rollout = self.now, self.in_call, self.ctx_sum, self.n_rollout
            pushing = now < self.push_until - _EPS
            serving = 0 if pushing else n_rollout
            if one:
                if n != k_n or serving != k_serving or cs != k_cs:
                    k_n, k_serving, k_cs = n, serving, cs
                    speed = (rate_fn(n, serving, cs / n if n else 0.0),)
            else:
                key = tuple(lane_calls)
                if n != k_n or serving != k_serving or cs != k_cs or key != k_lanes:
                    k_n, k_serving, k_cs, k_lanes = n, serving, cs, key
                    speed = lane_speeds(serving)
            # the next event: a queued one, a call's end in a lane, or the open step's training end
            t = events[0][0] if events else inf
            if one:
                v = speed[0]
                if calls0 and v > 0:
                    d = calls0[0][0] - vclocks[0]
                    x = now + (d if d > 0.0 else 0.0) / v  # max(0.0, d)
                    if x < t:
                        t = x
            else:
                for calls, vc, v in zip(lanes, vclocks, speed):
                    if calls and v > 0:
                        d = calls[0][0] - vc
                        x = now + (d if d > 0.0 else 0.0) / v
                        if x < t:
                            t = x
            left = self.train_left
            rate = self.n_train * tps
            drains = left > _EPS and rate > 0
            if drains:
                x = now + left / rate
                if x < t:
                    t = x
            if t > give_up_after or t == inf:  # (strictly: a run as fast as the limit may win a tie)
                if t == inf:
                    raise SimError(f"{self.p.label}: nothing left to happen at t={self.now:.0f}s")
                raise GaveUp(t)  # its makespan is at least t
            dt = t - now
            if dt > 0:  # move the clock to t
                # During the optimizer step trainers are busy; during a weight push rollout cells pause.
                optimizing = now < self.opt_until - _EPS
                key = (self.roles_rev, n if n < n_rollout else n_rollout, pushing, drains or optimizing)
                if key != self._busy_key:
                    self._busy_key = key
                    a = self._assignment(*key[1:])
                    if a is not self.busy_a:
                        self._busy_changed(a)
                running = self.running
                if running and not n_rollout:
                    self.unserved += dt
                if self.win_open:
                    spare = n_cells - n / knee
                    self.win_spare += (spare if spare > 0.0 else 0.0) * dt  # max(0.0, spare)
                # Regime: rollout is the critical path while executions run (or await evaluation)
                # and the trainers have nothing admitted to train.
                if (running or self.awaiting_eval) and left <= _EPS and not optimizing:
                    self.crit_roll += dt
                if n and n_rollout and not pushing:  # calls per busy replica (ClusterModel.batch)
                    b = n / (n_rollout * reps)
                    self.load_num += n * (b if b > 1.0 else 1.0) * dt
                    self.load_den += n * dt
                if one:
                    vclocks[0] += speed[0] * dt
                else:
                    for i, v in enumerate(speed):
                        vclocks[i] += v * dt
                if drains:
                    d = rate * dt
                    if d > left:  # min(left, rate * dt)
                        d = left
                    if mbq and mbq[0][1] > d + 1e-3:  # _drain when the head micro-batch takes it all
                        self.train_left = left - d
                        mb, rem = mbq[0]
                        mbq[0] = (mb, rem - d)
                    else:
                        drain(d)
                self.now = t
            # everything due now: calls that ended, then events (most are a call's prefill or its
            # tool time). Calls and tool time inside an execution change nothing a policy decides
            # on, so only execution ends, evaluations, switches, step ends and ticks wake the policy.
            progressed = wake = False
            done = 0
            if one:
                if calls0:
                    vc = vclocks[0]
                    due = vc + _EPS * (vc if vc > 1.0 else 1.0)  # max(1.0, vc)
                    while calls0 and calls0[0][0] <= due:
                        end_call(heappop(calls0)[2])
                        done += 1
            else:
                for calls, vc in zip(lanes, vclocks):
                    if calls:
                        due = vc + _EPS * (vc if vc > 1.0 else 1.0)
                        while calls and calls[0][0] <= due:
                            end_call(heappop(calls)[2])
                            done += 1
            progressed = done > 0
            due = self.now + _EPS
            while events and events[0][0] <= due:
                _, _, kind, obj = heappop(events)
                done += 1
                if kind == _PREFILL:
                    progressed = True
                    decode(obj)
                elif kind == _ENV:
                    progressed = True
                    if end_env(obj):
                        wake = True
                elif kind == _TICK:
                    self._push(self.now + self.s.tick_s, _TICK, None)
                    wake = True
                else:
                    progressed = wake = True
                    event(kind, obj)
            self.n_events += done
            if self._maybe_ready and not self.opt_until:
                self._maybe_ready = False
                if core.step_ready():
                    progressed = wake = True
                    self._ready()
            progressed |= self.train_left < left  # training drained work (a long step has no events)
            if core.version >= steps:
                break
            idle_ticks = 0 if progressed else idle_ticks + 1
            if idle_ticks > 1000:
                raise SimError(f"{self.p.label}: no progress for 1000 ticks at t={self.now:.0f}s")
            if wake:
                self._decide()
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
                        self._home(e)
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
        end = self.now
        ended = {e.id: e.group.id for e in self.running.values()}
        for rec in self.core.unfinished():
            ended.update(dict.fromkeys(self.groups[rec.id].exec_ids, rec.id))
        for eid, gid in ended.items():
            self._drop(eid, gid, "run_ended")
        for i, b in enumerate(self.busy_a or ()):  # close the busy stretches still open
            if (b == 0 or b == 1) and end > self.busy_since[i]:
                self._emit(CellBusy(self.busy_since[i], end, i, ROLLOUT if b == 0 else TRAIN))
        self._emit(RunEnded(end))
        st = self.stats
        cells = [st.cell_time(i) for i in st.cell_ids()]
        roll, train = sum(x["rollout_s"] for x in cells), sum(x["train_s"] for x in cells)
        roll_idle = sum(max(0.0, x["rollout_s"] - x["busy_rollout_s"] - x["pushing_s"]) for x in cells)
        train_idle = sum(max(0.0, x["train_s"] - x["busy_train_s"]) for x in cells)
        c = self.c
        exact = self.p.staleness == 0 and self.core.spec.steps_per_sync == 1
        window = self.core.spec.staleness_rule == StalenessRule.WINDOW
        arrival = window and self.core.spec.steps_per_sync == 1  # versions bound which groups each step trains
        bound = lower_bound_trained(self.w, c, self.trained_by_step, arrival=arrival, max_open=(
            self.core.spec.steps_per_sync * self.core.spec.groups_per_step * (self.p.staleness + 1) if window else 0),
            staleness=self.p.staleness)
        return SimResult(
            label=self.p.label, scheme=self.p.scheme, staleness=self.p.staleness, nodes=c.nodes,
            cells=c.cells, cell_size=c.cell_nodes, gpus_per_cell=c.gpus_per_cell, steps=self.core.spec.steps,
            groups_per_step=self.core.spec.groups_per_step, group_size=self.w.group_size, makespan_s=end,
            lower_bound_s=bound, cell_stats=cells, step_stats=st.steps, executions_started=self.next_exec,
            executions_trained=sum(1 for o in self.outcomes.values() if o[0] == "trained"),
            not_admitted=dict(st.dropped_reasons), unserved_s=self.unserved, events=self.n_events,
            decisions=self.decisions, wall_s=wall,
            mean_rollout_h=self.exec_time / max(1, self.execs_ended) / 3600,
            mean_query_h=_mean([g.slowest for g in self.groups.values() if g.left == 0]) / 3600,
            query_ge_4h_share=_mean([float(g.slowest >= 4 * 3600) for g in self.groups.values() if g.left == 0]),
            staleness_rule=self.core.spec.staleness_rule, steps_per_sync=self.core.spec.steps_per_sync,
            lag=asdict(st.lag()), dropped_groups=st.groups_dropped,
            rollout_critical_share=self.crit_roll / end if end else 0.0,
            trainer_idle_share=train_idle / train if train else 0.0,
            rollout_idle_share=roll_idle / roll if roll else 0.0,
            mean_batch=self.load_num / self.load_den if self.load_den else 0.0,
            model_wait_share=1.0 - self.tool_time / self.exec_time if self.exec_time else 0.0,
            evictions=self.evictions, reprefills=self.reprefills,
            # a step's rollout window is defined only when each step rolls out its own batch
            slack=(sum(self.slacks) / len(self.slacks) if self.slacks else 0.0) if exact else None,
            bound_basis=("the groups actually trained: work" + (", open-group concurrency" if window else "")
                         + (f", per-step arrival at staleness {self.p.staleness}" if arrival else "")),
            outcomes=self.outcomes,
            roles=[[(a, b, role) for role, a, b in st.intervals(i) if b > a] for i in st.cell_ids()],
            idle=[st.idle_spans(i) if self.s.record else [] for i in st.cell_ids()])


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def simulate(spec: RunSpec, workload: Workload, cluster: ClusterModel, sim: SimSpec | None = None,
             on_event: Callable[[Event], object] | None = None, give_up_after: float = math.inf) -> SimResult:
    return Simulator(spec, workload, cluster, sim, on_event).run(give_up_after)
