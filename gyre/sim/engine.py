"""Discrete-event simulator that drives a ``gyre.sched`` policy, unchanged.

Events: execution start and end, model calls and environment time inside an execution (grouped
into segments of calls), evaluation, training (streamed: admitted work drains at the rate of the
training cells), role switches, weight pushes, and a periodic tick so a policy can revise its
estimates. Decoding is a fluid processor-sharing pool over the rollout cells: every call in flight
progresses at ``ClusterModel.speed(calls in flight, serving cells)`` reference-seconds per second,
tracked with one virtual clock so a change of load costs O(1) instead of touching every call.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import dataclass

from gyre.config import ConfigError
from gyre.sched.admission import expired, pick
from gyre.sched.policy import Policy
from gyre.sched.state import CellView, ClusterState, Decision, ExecView, GroupView, Role
from gyre.sim.bound import lower_bound
from gyre.sim.cluster import ClusterModel
from gyre.sim.result import BUCKETS, CellStats, SimResult, StepStats
from gyre.sim.workload import Workload

_EPS = 1e-9
_ENV, _EVAL, _SWITCH, _PUSH, _TICK = range(5)


class SimError(RuntimeError):
    """The simulation cannot make progress (a policy that never trains, a deadlock)."""


@dataclass
class SimSpec:
    steps: int = 48
    groups_per_step: int = 16
    segments: int = 8          # model-call/environment segments per execution
    tick_s: float = 300.0      # policy re-evaluation period when nothing else happens
    record: bool = True        # keep role and usage timelines (plots)

    def __post_init__(self) -> None:
        if self.steps < 1 or self.groups_per_step < 1 or self.segments < 1:
            raise ConfigError("steps, groups_per_step and segments must be >= 1")
        if self.tick_s <= 0:
            raise ConfigError(f"tick_s must be positive, got {self.tick_s}")


class _Exec:
    __slots__ = ("id", "group", "version", "started_at", "seg", "env_seg", "model_seg",
                 "calls_seg", "calls_done", "in_call", "view", "spec", "home", "call_seq", "extra", "lost_at")

    def __init__(self, eid, group, version, now, spec, segments, model_share):
        self.id, self.group, self.version, self.started_at, self.spec = eid, group, version, now, spec
        self.seg = 0
        self.env_seg = spec.duration_s * (1 - model_share) / segments
        self.model_seg = spec.duration_s * model_share / segments
        self.calls_seg = spec.calls / segments
        self.calls_done = 0.0
        self.in_call = False
        self.view = None
        self.home = -1        # rollout cell holding its KV/prefix cache; -1 = none
        self.call_seq = -1    # identifies its call's entry in the decode heap
        self.extra = 0.0      # re-prefill owed to the next call after a lost cache
        self.lost_at = -1.0   # when it last lost its cache (it is rebuilt once, not per move)


class _Group:
    __slots__ = ("id", "spec", "version", "left", "ready_at", "state", "tokens", "exec_ids", "slowest")

    def __init__(self, gid, spec, version):
        self.id, self.spec, self.version = gid, spec, version
        self.left = len(spec.execs)
        self.ready_at = math.inf
        self.state = "running"  # running -> waiting -> assigned -> trained | dropped
        self.tokens = sum(e.train_tokens for e in spec.execs)
        self.exec_ids: list[int] = []
        self.slowest = 0.0  # wall time of its slowest execution so far


class Simulator:
    def __init__(self, policy: Policy, workload: Workload, cluster: ClusterModel, spec: SimSpec) -> None:
        self.p, self.w, self.c, self.s = policy, workload, cluster, spec
        n = cluster.cells
        roles = policy.initial_roles(n)
        if len(roles) != n:
            raise ConfigError(f"{policy.label}: initial_roles gave {len(roles)} roles for {n} cells")
        self.role = list(roles)
        self.since = [0.0] * n
        self.now = 0.0
        self.version = 0
        self.events: list = []
        self.seq = itertools.count()
        self.n_events = 0
        self.decisions = 0
        # decode pool
        self.vclock = 0.0
        self.calls: list = []          # (virtual finish, seq, exec)
        self.in_call = 0
        self.push_until = 0.0
        # executions and groups
        self.running: dict[int, _Exec] = {}
        self.groups: list[_Group] = []
        self.waiting: dict[int, _Group] = {}
        self.open_groups = 0
        self.next_exec = 0
        self.outcomes: dict[int, tuple] = {}
        # the open step
        self.step_groups: list[_Group] = []
        self.train_left = 0.0
        self.train_done = 0.0
        self.step_start = 0.0
        self.steps: list[StepStats] = []
        self.trained_groups = 0
        # accounting
        self.n_rollout = sum(1 for r in roles if r is Role.ROLLOUT)
        self.n_train = sum(1 for r in roles if r is Role.TRAIN)
        self.roles_rev = 0
        self._assign_cache: dict = {}
        self._assign_counts: dict = {}
        self._acc: dict[tuple[int, ...], float] = {}  # cell-bucket assignment -> seconds
        self.homed = [0] * n  # executions whose cache lives on each cell
        self.switches = [[0, 0] for _ in range(n)]
        self.unserved = 0.0
        self.exec_time = 0.0  # wall seconds of ended executions (their observed durations)
        self.execs_ended = 0
        self.role_log: list[list[tuple[float, float, str]]] = [[] for _ in range(n)]
        self.role_open = [(0.0, r.value) for r in roles]
        self.usage: list[tuple[float, int, int, int, int]] = []
        self.buckets: list[tuple[float, tuple[int, ...]]] = []  # when each cell's bucket changed
        self._push(spec.tick_s, _TICK, None)

    # ---- event plumbing -------------------------------------------------------------------
    def _push(self, t: float, kind: int, obj) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, obj))

    def _serving(self) -> int:
        return 0 if self.now < self.push_until - _EPS else self.n_rollout

    def _speed(self) -> float:
        return self.c.speed(self.in_call, self._serving())

    def _train_rate(self) -> float:
        return self.c.train_rate(self.n_train)

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
            self._assign_counts[a] = tuple(out.count(b) for b in range(4))
        return a

    def _advance(self, t: float) -> None:
        dt = t - self.now
        if dt <= 0:
            return
        speed, rate = self._speed(), self._train_rate()
        pushing = self.now < self.push_until - _EPS
        # During the optimizer step and weight push, trainers are busy and rollout cells pause.
        training = (self.train_left > _EPS and rate > 0) or pushing
        a = self._assignment(min(self.in_call, self.n_rollout), pushing, training)
        self._acc[a] = self._acc.get(a, 0.0) + dt
        if self.running and not self.n_rollout:
            self.unserved += dt
        if self.s.record:
            counts = self._assign_counts[a]
            if not self.usage or self.usage[-1][1:] != counts:
                self.usage.append((self.now, *counts))
            if not self.buckets or self.buckets[-1][1] is not a:
                self.buckets.append((self.now, a))
        self.vclock += speed * dt
        if self.train_left > _EPS and rate > 0:
            done = min(self.train_left, rate * dt)
            self.train_left -= done
            self.train_done += done
            if self.train_left < 1e-3:  # float residue of a finished drain, not work
                self.train_done += self.train_left
                self.train_left = 0.0
        self.now = t

    def _next_time(self) -> float:
        t = self.events[0][0] if self.events else math.inf
        speed = self._speed()
        if self.calls and speed > 0:
            t = min(t, self.now + max(0.0, self.calls[0][0] - self.vclock) / speed)
        rate = self._train_rate()
        if self.train_left > _EPS and rate > 0:
            t = min(t, self.now + self.train_left / rate)
        return t

    # ---- executions -----------------------------------------------------------------------
    def _start_group(self) -> None:
        gid = len(self.groups)
        g = _Group(gid, self.w.group(gid), self.version)
        self.groups.append(g)
        self.open_groups += 1
        for spec in g.spec.execs:
            e = _Exec(self.next_exec, g, self.version, self.now, spec, self.s.segments, self.w.model_share)
            self.next_exec += 1
            g.exec_ids.append(e.id)
            self.running[e.id] = e
            self._home(e)
            self._begin_call(e)

    def _begin_call(self, e: _Exec) -> None:
        e.in_call, e.view = True, None
        self.in_call += 1
        self._queue_call(e, e.model_seg + e.extra)
        e.extra = 0.0

    def _queue_call(self, e: _Exec, work: float) -> None:
        e.call_seq = next(self.seq)
        heapq.heappush(self.calls, (self.vclock + work, e.call_seq, e))

    def _home(self, e: _Exec) -> None:
        """Place an execution on the least-loaded settled rollout cell (the router's choice)."""
        best = -1
        for i, r in enumerate(self.role):
            if r is Role.ROLLOUT and (best < 0 or self.homed[i] < self.homed[best]):
                best = i
        e.home = best
        if best >= 0:
            self.homed[best] += 1

    def _evict(self, cell: int) -> None:
        """A cell leaves rollout: its executions lose their KV cache and move to other cells."""
        self.homed[cell] = 0
        for e in self.running.values():
            if e.home != cell:
                continue
            self._home(e)
            if self.c.reprefill_s <= 0 or e.lost_at == self.now:
                continue
            e.lost_at = self.now
            if e.in_call:  # the call in flight is retried elsewhere and re-prefills its context
                for j, (v, sq, x) in enumerate(self.calls):
                    if sq == e.call_seq:
                        self.calls[j] = (v + self.c.reprefill_s, sq, x)
                        heapq.heapify(self.calls)
                        break
            else:
                e.extra += self.c.reprefill_s

    def _end_call(self, e: _Exec) -> None:
        e.in_call, e.view = False, None
        self.in_call -= 1
        e.calls_done += e.calls_seg
        self._push(self.now + e.env_seg, _ENV, e)

    def _end_env(self, e: _Exec) -> bool:
        """Next segment, or the execution ends (True)."""
        e.seg += 1
        if e.seg < self.s.segments:
            self._begin_call(e)
            return False
        del self.running[e.id]
        if e.home >= 0:
            self.homed[e.home] -= 1
        took = self.now - e.started_at
        self.exec_time += took
        self.execs_ended += 1
        e.group.slowest = max(e.group.slowest, took)
        self._push(self.now + self.c.eval_s, _EVAL, e)
        return True

    def _evaluated(self, e: _Exec) -> None:
        g = e.group
        g.left -= 1
        if g.left == 0:
            g.ready_at = self.now
            if expired(self.version, g.version, self.p.staleness):
                self._close(g, ("not_admitted", "stale"))
                return
            g.state = "waiting"
            self.waiting[g.id] = g
            self._fill_step()

    # ---- training steps -------------------------------------------------------------------
    def _fill_step(self) -> None:
        """Assign admissible waiting groups to the open step in the policy's admission order."""
        room = self.s.groups_per_step - len(self.step_groups)
        if room <= 0 or not self.waiting:
            return
        views = [GroupView(g.id, g.version, g.ready_at, g.tokens) for g in self.waiting.values()]
        for v in pick(views, self.version, self.p.staleness, room, self.p.admission_key):
            g = self.waiting.pop(v.id)
            g.state = "assigned"
            self.step_groups.append(g)
            self.train_left += g.tokens

    def _drop_expired(self) -> None:
        for g in [g for g in self.waiting.values() if expired(self.version, g.version, self.p.staleness)]:
            del self.waiting[g.id]
            self._close(g, ("not_admitted", "stale"))

    def _close(self, g: _Group, outcome: tuple) -> None:
        g.state = "trained" if outcome[0] == "trained" else "dropped"
        self.open_groups -= 1
        for eid in g.exec_ids:
            self.outcomes[eid] = outcome

    def _finish_step(self) -> None:
        s = self.version
        lags = [s - g.version for g in self.step_groups]
        toks = [g.tokens for g in self.step_groups]
        self.steps.append(StepStats(
            step=s, start_s=self.step_start, end_s=self.now, groups=len(lags),
            staleness_group_mean=sum(lags) / len(lags),
            staleness_token_mean=sum(l * t for l, t in zip(lags, toks)) / sum(toks),
            staleness_max=max(lags)))
        for g in self.step_groups:
            self._close(g, ("trained", s))
        self.trained_groups += len(self.step_groups)
        self.step_groups, self.train_done, self.train_left = [], 0.0, 0.0
        self.version += 1
        self.step_start = self.now
        self._drop_expired()
        self._fill_step()

    # ---- policy ---------------------------------------------------------------------------
    def _state(self) -> ClusterState:
        running = []
        for e in self.running.values():
            if e.view is None:
                e.view = ExecView(e.id, e.group.id, e.version, e.started_at, int(e.calls_done), e.in_call)
            running.append(e.view)
        need = self.s.steps * self.s.groups_per_step - self.trained_groups - self.open_groups
        return ClusterState(
            version=self.version, staleness=self.p.staleness, groups_per_step=self.s.groups_per_step,
            group_size=self.w.group_size,
            cells=tuple(CellView(i, r, self.since[i]) for i, r in enumerate(self.role)),
            running=tuple(running), groups_open=self.open_groups,
            groups_waiting=sum(1 for g in self.waiting.values() if not expired(self.version, g.version, self.p.staleness)),
            step_groups=len(self.step_groups), train_tokens_left=self.train_left,
            train_tokens_done=self.train_done, starts_blocked=need <= 0)

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
            self.switches[i][0 if to_train else 1] += 1
            self._push(self.now + (self.c.to_train_s if to_train else self.c.to_rollout_s), _SWITCH, i)
        need = self.s.steps * self.s.groups_per_step - self.trained_groups - self.open_groups
        for _ in range(min(d.start_groups, max(0, need))):
            self._start_group()

    def _set_role(self, i: int, role: Role) -> None:
        t0, name = self.role_open[i]
        if self.now > t0:
            self.role_log[i].append((t0, self.now, name))
        self.role_open[i] = (self.now, role.value)
        self.n_rollout += (role is Role.ROLLOUT) - (self.role[i] is Role.ROLLOUT)
        self.n_train += (role is Role.TRAIN) - (self.role[i] is Role.TRAIN)
        self.roles_rev += 1
        self.role[i] = role
        self.since[i] = self.now

    # ---- main loop ------------------------------------------------------------------------
    def run(self) -> SimResult:
        wall = time.perf_counter()
        self.decisions += 1
        self._apply(self.p.decide(self._state(), self.now))
        idle_ticks = 0
        while len(self.steps) < self.s.steps:
            t = self._next_time()
            if t == math.inf:
                raise SimError(f"{self.p.label}: nothing left to happen at t={self.now:.0f}s")
            self._advance(t)
            progressed, wake = self._handle_due()
            if len(self.steps) >= self.s.steps:
                break
            idle_ticks = 0 if progressed else idle_ticks + 1
            if idle_ticks > 1000:
                raise SimError(f"{self.p.label}: no progress for 1000 ticks at t={self.now:.0f}s")
            if wake:
                self.decisions += 1
                self._apply(self.p.decide(self._state(), self.now))
        return self._result(time.perf_counter() - wall)

    def _handle_due(self) -> tuple[bool, bool]:
        """Process everything due now. Returns (progressed, the policy should look again):
        calls and environment time inside an execution change nothing a policy decides on, so
        only execution ends, evaluations, switches, step ends and ticks wake the policy."""
        progressed = wake = False
        while self.calls and self.calls[0][0] <= self.vclock + _EPS * max(1.0, self.vclock):
            self._end_call(heapq.heappop(self.calls)[2])
            self.n_events += 1
            progressed = True
        while self.events and self.events[0][0] <= self.now + _EPS:
            _, _, kind, obj = heapq.heappop(self.events)
            self.n_events += 1
            if kind == _TICK:
                self._push(self.now + self.s.tick_s, _TICK, None)
                wake = True
                continue
            progressed = True
            if kind == _ENV:
                wake |= self._end_env(obj)
            elif kind == _EVAL:
                wake = True
                self._evaluated(obj)
            elif kind == _SWITCH:
                wake = True
                self._set_role(obj, Role.TRAIN if self.role[obj] is Role.TO_TRAIN else Role.ROLLOUT)
                if self.role[obj] is Role.ROLLOUT:
                    for e in self.running.values():
                        if e.home < 0:
                            self._home(e)
            elif kind == _PUSH:
                wake = True
                self.push_until = 0.0
                self._finish_step()
        if (not self.push_until and self.step_groups and len(self.step_groups) >= self.s.groups_per_step
                and self.train_left <= 0.0):
            self.train_left = 0.0
            progressed = wake = True
            if self.c.push_s > 0:  # optimizer step and weight push, then the version moves on
                self.push_until = self.now + self.c.push_s
                self._push(self.push_until, _PUSH, None)
            else:
                self._finish_step()
        return progressed, wake

    def _result(self, wall: float) -> SimResult:
        end = self.now
        for i in range(len(self.role)):
            t0, name = self.role_open[i]
            if end > t0:
                self.role_log[i].append((t0, end, name))
        for e in list(self.running.values()):
            self.outcomes[e.id] = ("not_admitted", "run_ended")
        for g in self.groups:
            if g.state in ("running", "waiting", "assigned"):
                for eid in g.exec_ids:
                    self.outcomes[eid] = ("not_admitted", "run_ended")
        reasons: dict[str, int] = {}
        for o in self.outcomes.values():
            if o[0] == "not_admitted":
                reasons[o[1]] = reasons.get(o[1], 0) + 1
        trained = sum(1 for o in self.outcomes.values() if o[0] == "trained")
        sec = [dict.fromkeys(BUCKETS, 0.0) for _ in self.role]
        for a, dt in self._acc.items():
            for i, b in enumerate(a):
                sec[i][BUCKETS[b]] += dt
        c = self.c
        return SimResult(
            label=self.p.label, scheme=self.p.scheme, staleness=self.p.staleness, nodes=c.nodes,
            cells=c.cells, cell_size=c.cell_nodes, gpus_per_cell=c.gpus_per_cell, steps=self.s.steps,
            groups_per_step=self.s.groups_per_step, group_size=self.w.group_size, makespan_s=end,
            lower_bound_s=lower_bound(self.w, c, self.s.steps, self.s.groups_per_step, self.p.staleness),
            cell_stats=[CellStats(i, sec[i], *self.switches[i]) for i in range(len(self.role))],
            step_stats=self.steps, executions_started=self.next_exec, executions_trained=trained,
            not_admitted=reasons, unserved_s=self.unserved, events=self.n_events,
            decisions=self.decisions, wall_s=wall,
            mean_rollout_h=self.exec_time / max(1, self.execs_ended) / 3600,
            mean_query_h=_mean([g.slowest for g in self.groups if g.left == 0]) / 3600,
            outcomes=self.outcomes, roles=self.role_log, usage=self.usage,
            idle=self._idle_spans(end))

    def _idle_spans(self, end: float) -> list[list[tuple[float, float]]]:
        """Per cell, the spans it sat idle in its role (for the Gantt chart)."""
        out: list[list[tuple[float, float]]] = [[] for _ in self.role]
        pts = self.buckets + [(end, None)]
        for (t0, a), (t1, _) in zip(pts, pts[1:]):
            for i, b in enumerate(a):
                if BUCKETS[b] != "idle" or t1 <= t0:
                    continue
                spans = out[i]
                if spans and spans[-1][1] == t0:
                    spans[-1] = (spans[-1][0], t1)
                else:
                    spans.append((t0, t1))
        return out


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def simulate(policy: Policy, workload: Workload, cluster: ClusterModel, spec: SimSpec | None = None) -> SimResult:
    return Simulator(policy, workload, cluster, spec or SimSpec()).run()
