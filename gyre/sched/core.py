"""The coordinator core: the lifecycle of groups and steps, one object for both drivers.

The live head (gyre/head.py) and the simulator (gyre/sim/simulator.py) observe different worlds
(processes and HTTP vs. a workload model) but tell this object the same events, in the same
order, and act on what it answers (ARCHITECTURE.md invariant 3):

    events in                                    answers out
    start_groups(n, now)                  ->     the groups started (ids never reused)
    execution_started / call_started /
    call_ended / execution_ended
    execution_evaluated(...)              ->     Admission: groups assigned to the open step, dropped
    microbatches_added / next_microbatch /
    microbatch_trained / microbatches_lost       (the open step's training work, streamed)
    step_ready() / step_ending(now) /
    step_aborted() / step_ended(now)      ->     StepResult: trained groups and their lags, push due?
    weights_pushed(version)
    cluster_state(now, cells)             ->     the ClusterState a policy decides on (the one builder)

It is pure and clock-free: every time is an argument, nothing sleeps, reads a clock or does I/O.
Policies stay in their own modules; the core only asks their admission order (a key function). Which
waiting groups a step takes is gyre.sched.picking's.

Group states: STARTED (the coordinator started it; no execution has begun) -> RUNNING -> EVALUATED
(every execution ended and was scored) -> WAITING (in the admission queue) -> ASSIGNED (in the open
step) -> TRAINED; or DROPPED (too stale for any step it could still reach, window rule only; or,
with `skip_zero_variance`, every execution scored the same reward, so a baseline-relative
advantage gives it no signal: reason `zero_variance`, at most `max_replacements_per_step` per
open step, after which such groups train as they are). A dropped group is replaced: starts are
limited by the groups still *needed* (steps x Q - trained - open), never by how many were started,
so the last step always fills; under the count rule a zero-variance drop does not count as
started (AReaL counts accepted and running samples, not rejected ones), so its replacement can
start within the same sync.

Once every group the run needs has started (the window rule, groups admitted as they come rather
than a shuffled round at once), a step keeps a slot for each unevaluated group that would expire
when it ends, and fills the rest with newer groups: dropping such a straggler then means replacing
it with a group that starts from nothing, and the run cannot end before that one does. (The 122B
preset, 32 nodes, 16 groups a step, staleness 2, 4 steps: the slowest first-round group was scored
0.1 h after the fastest second-round one took step 2's last slot; its replacement ran 3.7 h and
ended the run at 8.25 h; with its slot kept, 7.68 h.) Earlier in a run a replacement only joins a
later step, while a step waiting for its stragglers delays every start: slots kept all run long,
E's 24-step staleness-2 run of the preset (256 groups a step) took 92.1 h; kept only at its end,
84.4 h (86.9 h and 505 groups dropped without; 445 with).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from enum import Enum
from typing import Hashable, Iterable

from gyre.config import BurstOrder, StalenessRule
from gyre.minibatch import minibatch_parts
from gyre.sched.picking import keeping_slots, shuffled
from gyre.sched.admission import RULES, AdmissionKey, count_budget, expired, fifo_key, sync_of, window_budget
from gyre.sched.state import CellView, ClusterState, ExecView, GroupView, RunningViews

_EPS = 1e-6
ZERO_VARIANCE = "zero_variance"  # the ledger's reason for a group dropped for equal rewards


@dataclass(frozen=True)
class ProxJob:
    """Queued work of a step with minibatches: pi_prox of micro-batch ``mb`` (a later part) at
    the step's start, before its first update (no gradient)."""
    mb: Hashable


class CoreError(RuntimeError):
    """An event the lifecycle does not allow (a driver bug, never user input)."""


class GroupState(str, Enum):
    STARTED = "started"
    RUNNING = "running"
    EVALUATED = "evaluated"
    WAITING = "waiting"
    ASSIGNED = "assigned"
    TRAINED = "trained"
    DROPPED = "dropped"

    @property
    def open(self) -> bool:
        """Counts against the in-flight budget (started, not yet trained or dropped)."""
        return self not in (GroupState.TRAINED, GroupState.DROPPED)


@dataclass(frozen=True)
class CoreSpec:
    steps: int                    # the run ends when `version` reaches this
    groups_per_step: int          # Q
    group_size: int               # G
    staleness: int = 0            # k, in rollout syncs
    staleness_rule: StalenessRule = StalenessRule.WINDOW
    steps_per_sync: int = 1       # b: optimizer steps fed by one rollout round
    start_version: int = 0        # version at job start (a resumed job starts past 0)
    first_group: int = 0          # next group id (a resumed job never reuses ids)
    skip_zero_variance: bool = False   # drop (and replace) groups whose rewards are all equal
    max_replacements_per_step: int = 0  # ... at most this many per open step
    burst_order: BurstOrder = BurstOrder.STREAM  # stream: a round's groups go to its steps as they finish;
    #                               shuffle: once the round's groups are in, in a seeded random order
    seed: int = 0                 # of the shuffle
    minibatches: int = 1          # optimizer updates per step (train.minibatches_per_step), one reduce each
    prox: bool = False            # the later minibatches need pi_prox at the step's start (tis, decoupled)

    def __post_init__(self) -> None:
        if self.staleness_rule not in RULES:
            raise ValueError(f"staleness_rule must be one of {RULES}, got {self.staleness_rule!r}")
        object.__setattr__(self, "staleness_rule", StalenessRule(self.staleness_rule))  # a member from here on
        for name in ("groups_per_step", "group_size", "steps_per_sync", "minibatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {self.staleness}")
        if self.burst_order not in tuple(BurstOrder):
            raise ValueError(f"burst_order must be one of {tuple(BurstOrder)}, got {self.burst_order!r}")
        object.__setattr__(self, "burst_order", BurstOrder(self.burst_order))
        if self.max_replacements_per_step < 0:
            raise ValueError(f"max_replacements_per_step must be >= 0, got {self.max_replacements_per_step}")

    @property
    def groups_per_round(self) -> int:
        return self.groups_per_step * self.steps_per_sync

    @property
    def groups_needed(self) -> int:
        """Groups this job must train to reach `steps`."""
        return max(0, self.steps - self.start_version) * self.groups_per_step


@dataclass
class ExecRecord:
    key: Hashable                 # the driver's execution id
    serial: int                   # small int for ExecView.id
    group: int
    started_at: float
    calls_done: float = 0.0
    in_call: bool = False
    ended_at: float | None = None
    evaluated: bool = False
    version: int = -1             # oldest policy version that served it (-1: made no call)
    tokens: float = 0.0
    usable: bool = True
    reward: float | None = None   # its score (None: unknown, never counted as equal to another)
    _view: ExecView | None = None

    def view(self, group_version: int) -> ExecView:
        if self._view is None:
            self._view = ExecView(self.serial, self.group, group_version, self.started_at)
        return self._view


@dataclass
class GroupRecord:
    id: int
    started_at: float
    started_version: int          # rollout version serving when it started
    state: GroupState = GroupState.STARTED
    executions: dict = field(default_factory=dict)   # key -> ExecRecord
    ready_at: float = math.inf    # when its last execution was evaluated
    version: int = -1             # oldest optimizer version that served it (set when evaluated)
    sync: int = -1                # rollout sync of that version
    train_tokens: float = 0.0
    step: int = -1                # step it trained in (or was assigned to)
    lag_steps: int | None = None  # optimizer-step lag when trained
    lag_syncs: int | None = None  # rollout-sync lag when trained
    reason: str = ""              # why it was dropped (stale: ..., or ZERO_VARIANCE)

    def view(self) -> GroupView:
        return GroupView(self.id, self.version, self.ready_at, self.train_tokens)


@dataclass
class StepRecord:
    index: int
    groups: list = field(default_factory=list)       # group ids, in assignment order
    started_at: float | None = None                   # first group assigned
    work: dict = field(default_factory=dict)          # micro-batch id -> tokens
    queue: list = field(default_factory=list)         # micro-batches waiting for a trainer
    in_flight: set = field(default_factory=set)
    done: set = field(default_factory=set)
    reducing: bool = False
    replaced: int = 0                                 # zero-variance groups dropped while it was open
    # minibatches (spec.minibatches > 1): the step's micro-batches, split once the step is full;
    # update j trains parts[j] then reduces. ProxJobs, queued with part 0, give the later parts
    # pi_prox at the step's start.
    parts: list | None = None
    update: int = 0
    # running sums, updated in event order (deterministic, and O(1) for the simulator's many reads)
    tokens_total: float = 0.0
    _done_sum: float = 0.0

    @property
    def tokens_done(self) -> float:
        return self.tokens_total if len(self.done) == len(self.work) else min(self._done_sum, self.tokens_total)

    @property
    def tokens_left(self) -> float:
        return 0.0 if len(self.done) == len(self.work) else max(0.0, self.tokens_total - self._done_sum)

    @property
    def trained(self) -> bool:
        """The open update's work is done (every micro-batch of the step, without minibatches)."""
        if self.parts is not None:
            return not self.queue and not self.in_flight and all(mb in self.done for mb in self.parts[self.update])
        return not self.queue and not self.in_flight and len(self.done) == len(self.work)

    @property
    def final(self) -> bool:
        """The open update is the step's last (the one that counts the step)."""
        return self.parts is None or self.update == len(self.parts) - 1


@dataclass(frozen=True)
class Admission:
    """What an event changed in the admission queue: the driver materializes `assigned` (into the
    open step) and records `dropped` as not admitted."""
    assigned: tuple[GroupRecord, ...] = ()
    dropped: tuple[GroupRecord, ...] = ()

    def __add__(self, other: "Admission") -> "Admission":
        return Admission(self.assigned + other.assigned, self.dropped + other.dropped)


@dataclass(frozen=True)
class StepResult:
    index: int                            # the step that ended
    version: int                          # optimizer version after it
    groups: tuple[GroupRecord, ...]       # trained in it, with lag_steps / lag_syncs set
    push_due: bool                        # end of a rollout round: push weights now
    started_at: float | None
    ended_at: float
    admission: Admission                  # what the next step received / what expired
    microbatches: tuple = ()              # the ended step's micro-batch ids (the driver frees their payload)
    replaced: int = 0                     # zero-variance groups dropped (and replaced) while it was open


class Coordinator:
    def __init__(self, spec: CoreSpec, admission_key: AdmissionKey = fifo_key) -> None:
        self.spec = spec
        self.key = admission_key
        self.version = spec.start_version          # optimizer steps done (= open step index)
        self.rollout_version = spec.start_version  # weights the rollout side serves
        self.groups: dict[int, GroupRecord] = {}
        self.execs: dict[Hashable, ExecRecord] = {}
        self.running: dict[Hashable, ExecRecord] = {}  # started, not ended
        self.step = StepRecord(self.version)
        self.steps: list[StepResult] = []
        self.next_group = spec.first_group
        self.started = 0            # groups started by this job
        self.trained = 0            # groups trained by this job
        self.zero_variance_dropped = 0  # groups dropped for equal rewards (replaced)
        self.n_open = 0
        self.calls_in_flight = 0
        self._serial = 0
        self._running_views: weakref.ref | None = None  # the RunningViews last handed out
        self._views: dict[Hashable, ExecView] = {}   # the running executions' views, built once each
        self._waiting: dict[int, GroupRecord] = {}  # the admission queue (kept: the simulator asks often)
        self._unready: dict[int, GroupRecord] = {}  # started, not every execution evaluated yet
        self._waiting_rev = 0                       # changes of _waiting, so its admissible count is kept
        self._waiting_key: tuple = ()               # (_waiting_rev, version) of _waiting_n
        self._waiting_n = 0

    # ---- queries ------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.version >= self.spec.steps

    @property
    def rollout_sync(self) -> int:
        return self.sync_of(self.rollout_version)

    def sync_of(self, version: int) -> int:
        return sync_of(version, self.spec.steps_per_sync, self.spec.start_version)

    def groups_in(self, *states: GroupState) -> list[GroupRecord]:
        return [g for g in self.groups.values() if g.state in states]

    @property
    def groups_still_needed(self) -> int:
        """Groups that must still start for the last step to fill (dropped ones are replaced)."""
        return max(0, self.spec.groups_needed - self.trained - self.n_open)

    def start_budget(self) -> int:
        return self._start_budget(self.groups_still_needed)

    def _start_budget(self, still_needed: int) -> int:
        s = self.spec
        if s.staleness_rule == StalenessRule.COUNT:
            rule = count_budget(s.groups_per_round, s.staleness, self.rollout_sync,
                                self.started - self.zero_variance_dropped)
        else:
            rule = window_budget(s.groups_per_step, s.staleness, self.n_open, s.steps_per_sync,
                                 self.rollout_sync, self.version - s.start_version)
        return min(rule, still_needed)

    def _expired(self, g: GroupRecord, step: int) -> bool:
        s = self.spec
        return expired(step, g.version, s.staleness, s.steps_per_sync, s.start_version, s.staleness_rule)

    def _admissible_waiting(self) -> int:
        """Waiting groups not expired at the current version. Expiry depends on a group's version
        only, so it is worked out once per version present (the queue can hold thousands of
        groups of a few versions, and is recounted at each of its changes)."""
        step, expired_at, n = self.version, {}, 0
        for g in self._waiting.values():
            x = expired_at.get(g.version)
            if x is None:
                x = expired_at[g.version] = self._expired(g, step)
            if not x:
                n += 1
        return n

    def cluster_state(self, now: float, cells: tuple[CellView, ...]) -> ClusterState:
        """The one builder of what a policy sees. While the step's optimizer step runs, one token
        of work is reported left: the trainers are still busy with it."""
        s, st = self.spec, self.step
        running = self._running_views() if self._running_views is not None else None
        if running is None:
            running = RunningViews(self._views)
            self._running_views = weakref.ref(running)
        if self._waiting_key != (self._waiting_rev, self.version):  # admissibility moves with these only
            self._waiting_key = (self._waiting_rev, self.version)
            self._waiting_n = self._admissible_waiting()
        waiting = self._waiting_n
        left = st.tokens_left
        if st.reducing:
            left = max(left, 1.0)
        done, still = self.done, self.groups_still_needed  # (read once: the simulator asks often)
        return ClusterState(
            version=self.version, staleness=s.staleness, groups_per_step=s.groups_per_step,
            group_size=s.group_size, cells=tuple(cells), running=running, groups_open=self.n_open,
            groups_waiting=waiting, step_groups=len(st.groups), train_tokens_left=left,
            train_tokens_done=st.tokens_done, starts_blocked=still <= 0 or done,
            starts_allowed=0 if done else self._start_budget(still), steps_per_sync=s.steps_per_sync,
            staleness_rule=s.staleness_rule, step_ready=self.step_ready(),
            calls_in_flight=self.calls_in_flight)

    # ---- groups and executions ----------------------------------------------------------------
    def start_groups(self, n: int, now: float) -> list[GroupRecord]:
        """Start up to n groups (never past the rule's budget or what the run still needs)."""
        out = []
        for _ in range(min(n, 0 if self.done else self.start_budget())):
            g = GroupRecord(self.next_group, now, self.rollout_version)
            self.next_group += 1
            self.started += 1
            self.n_open += 1
            self.groups[g.id] = g
            self._unready[g.id] = g
            out.append(g)
        return out

    def execution_started(self, group: int, key: Hashable, now: float) -> ExecRecord:
        g = self.groups[group]
        if g.state not in (GroupState.STARTED, GroupState.RUNNING):
            raise CoreError(f"group {group} is {g.state.value}: no execution can start in it")
        if len(g.executions) >= self.spec.group_size:
            raise CoreError(f"group {group} already has {self.spec.group_size} executions")
        e = ExecRecord(key, self._serial, group, now)
        self._serial += 1
        g.executions[key] = e
        g.state = GroupState.RUNNING
        self.execs[key] = e
        self.running[key] = e
        self._running_changes()
        self._views[key] = e.view(g.started_version)
        return e

    def _running_changes(self) -> None:
        """The running table is about to change: a state still held keeps its own copy."""
        views = self._running_views() if self._running_views is not None else None
        if views is not None:
            views._freeze()
        self._running_views = None

    def call_started(self, key: Hashable) -> None:
        e = self.execs[key]
        if not e.in_call and e.ended_at is None:
            e.in_call = True
            self.calls_in_flight += 1

    def call_ended(self, key: Hashable, calls: float = 1.0) -> None:
        e = self.execs[key]
        if e.in_call:
            e.in_call = False
            self.calls_in_flight -= 1
        e.calls_done += calls

    def execution_ended(self, key: Hashable, now: float) -> None:
        e = self.execs[key]
        if e.ended_at is None:
            if e.in_call:
                self.calls_in_flight -= 1
            e.ended_at, e.in_call = now, False
            self.running.pop(key, None)
            self._running_changes()
            self._views.pop(key, None)

    def execution_evaluated(self, key: Hashable, now: float, *, version: int = -1, tokens: float = 0.0,
                            usable: bool = True, reward: float | None = None) -> Admission:
        """An execution was scored. `version`: the oldest policy version that served it (-1: it
        made no call); `tokens`: its training tokens; `usable`: it can train (finished, scored);
        `reward`: its score (for the zero-variance rule). When its group's last execution is
        scored the group enters admission."""
        e = self.execs[key]
        self.execution_ended(key, now)
        if e.evaluated:
            raise CoreError(f"execution {key!r} evaluated twice")
        e.evaluated, e.version, e.tokens, e.usable = True, version, tokens, usable
        e.reward = reward if reward is not None and math.isfinite(reward) else None
        g = self.groups[e.group]
        if len(g.executions) < self.spec.group_size or not all(x.evaluated for x in g.executions.values()):
            return Admission()
        del self._unready[g.id]
        versions = [x.version for x in g.executions.values() if x.version >= 0]
        g.version = min(versions) if versions else g.started_version
        g.sync = self.sync_of(g.version)
        g.ready_at, g.state = now, GroupState.EVALUATED
        g.train_tokens = float(sum(x.tokens for x in g.executions.values()))
        if self._expired(g, self.version):
            return Admission(dropped=(self._drop(g),))
        if self._zero_variance(g) and self.step.replaced < self.spec.max_replacements_per_step:
            self.step.replaced += 1
            self.zero_variance_dropped += 1
            # a slot kept for it is free again (its replacement may turn the keeping off)
            return Admission(dropped=(self._drop(g, ZERO_VARIANCE),)) + self._fill(now)
        g.state = GroupState.WAITING
        self._waiting[g.id] = g
        self._waiting_rev += 1
        return self._fill(now)

    def _zero_variance(self, g: GroupRecord) -> bool:
        """Every usable execution (two at least) scored the same reward: no relative signal."""
        if not self.spec.skip_zero_variance:
            return False
        usable = [x for x in g.executions.values() if x.usable]
        if len(usable) < 2 or any(x.reward is None for x in usable):
            return False
        rewards = [x.reward for x in usable]
        return max(rewards) - min(rewards) <= _EPS

    def _drop(self, g: GroupRecord, reason: str = "") -> GroupRecord:
        s = self.spec
        g.reason = reason or (f"stale: served by v{g.version} (sync {g.sync}), step {self.version} "
                              f"(sync {self.sync_of(self.version)}), bound {s.staleness} sync(s)")
        g.state = GroupState.DROPPED
        self._waiting.pop(g.id, None)
        self._waiting_rev += 1
        self.n_open -= 1
        return g

    def _fill(self, now: float) -> Admission:
        """Assign admissible waiting groups to the open step, in the policy's admission order."""
        st, s = self.step, self.spec
        room = s.groups_per_step - len(st.groups)
        if room <= 0 or st.reducing or self.done:
            return Admission()
        if not self._waiting:
            return Admission()
        waiting = [g.view() for g in self._waiting.values()]
        if s.burst_order is BurstOrder.SHUFFLE and s.steps_per_sync > 1:
            chosen = shuffled(s, self.version, st.index, self.key, waiting, room)
        else:  # slots kept for the groups expiring with this step (gyre.sched.picking)
            chosen = keeping_slots(s, self.version, self.key, waiting, room, self.groups_still_needed,
                                   (g.started_version for g in self._unready.values()))
        out = []
        for v in chosen:
            g = self.groups[v.id]
            g.state, g.step = GroupState.ASSIGNED, st.index
            del self._waiting[g.id]
            self._waiting_rev += 1
            st.groups.append(g.id)
            out.append(g)
        if out and st.started_at is None:
            st.started_at = now
        return Admission(assigned=tuple(out))

    # ---- training work of the open step ---------------------------------------------------------
    def microbatches_added(self, group: int, tokens: dict) -> None:
        """The driver materialized an assigned group: micro-batch id -> tokens, queued in order."""
        g = self.groups[group]
        if g.state is not GroupState.ASSIGNED or g.step != self.step.index:
            raise CoreError(f"group {group} is not assigned to the open step {self.step.index}")
        for mb, t in tokens.items():
            if mb in self.step.work:
                raise CoreError(f"micro-batch {mb!r} added twice")
            self.step.work[mb] = float(t)
            self.step.tokens_total += float(t)
            if self.spec.minibatches == 1:  # else queued by update once the step is full (_split)
                self.step.queue.append(mb)

    def _full(self) -> bool:
        return len(self.step.groups) >= self.spec.groups_per_step

    def _split(self) -> None:
        """Minibatches: once every group of the step is in (the driver materializes a group when it
        is assigned), its micro-batches split into parts; part 0 and the prox jobs queue."""
        st = self.step
        if self.spec.minibatches == 1 or st.parts is not None or not self._full():
            return
        st.parts = minibatch_parts(st.work, self.spec.minibatches)
        st.queue.extend(st.parts[0])
        if self.spec.prox:
            st.queue.extend(ProxJob(mb) for part in st.parts[1:] for mb in part)

    def next_microbatch(self) -> Hashable | None:
        """The next queued micro-batch for an idle trainer (work goes by progress); with
        minibatches, a `ProxJob` asks for pi_prox of a later part's micro-batch."""
        self._split()
        if not self.step.queue or self.step.reducing:
            return None
        mb = self.step.queue.pop(0)
        self.step.in_flight.add(mb)
        return mb

    def microbatch_trained(self, mb: Hashable) -> None:
        st = self.step
        if isinstance(mb, ProxJob):  # its log-probs are with the driver
            st.in_flight.discard(mb)
            return
        if mb not in st.work:
            raise CoreError(f"micro-batch {mb!r} is not part of step {st.index}")
        st.in_flight.discard(mb)
        if mb not in st.done:
            st.done.add(mb)
            st._done_sum += st.work[mb]

    def microbatches_lost(self, mbs: Iterable[Hashable]) -> None:
        """A trainer died: these go back to the queue (their gradients are recomputed)."""
        st = self.step
        for mb in mbs:
            if isinstance(mb, ProxJob) and mb in st.in_flight:  # failed: asked again
                st.in_flight.discard(mb)
                st.queue.append(mb)
                continue
            if mb not in st.work or (st.parts is not None and mb not in st.parts[st.update]):
                continue  # an earlier update's gradients are applied already
            st.in_flight.discard(mb)
            if mb in st.done:
                st.done.discard(mb)
                st._done_sum -= st.work[mb]
            if mb not in st.queue:
                st.queue.append(mb)

    # ---- step end -------------------------------------------------------------------------------
    def step_ready(self) -> bool:
        """The open step is full and the open update's work trained: its reduce and optimizer
        update may run (`step.final`: the step's last, `step_ended`; else `update_applied`)."""
        st = self.step
        self._split()
        return (not self.done and not st.reducing and self._full() and st.trained
                and (self.spec.minibatches == 1 or st.parts is not None))

    def update_applied(self) -> None:
        """An update inside the step was applied everywhere: the next part queues."""
        st = self.step
        if not st.reducing or st.final:
            raise CoreError(f"step {st.index}: update {st.update} is not an update inside the step")
        st.reducing = False
        st.update += 1
        st.queue.extend(st.parts[st.update])

    def step_ending(self, now: float) -> None:
        if not self.step_ready():
            raise CoreError(f"step {self.step.index} is not ready to end")
        self.step.reducing = True

    def step_aborted(self) -> None:
        """The optimizer step could not run (lost gradients are requeued): work resumes."""
        self.step.reducing = False

    def step_ended(self, now: float) -> StepResult:
        st, s = self.step, self.spec
        if not st.reducing:
            raise CoreError(f"step {st.index} ended without step_ending")
        trained = []
        for gid in st.groups:
            g = self.groups[gid]
            g.state = GroupState.TRAINED
            g.lag_steps = st.index - g.version
            g.lag_syncs = self.sync_of(st.index) - g.sync
            self.n_open -= 1
            self.trained += 1
            trained.append(g)
        self.version += 1
        push_due = (self.version - s.start_version) % s.steps_per_sync == 0 or self.done
        self.step = StepRecord(self.version)
        dropped = tuple(self._drop(g) for g in list(self._waiting.values())
                        if self._expired(g, self.version))
        adm = Admission(dropped=dropped) + self._fill(now)
        res = StepResult(st.index, self.version, tuple(trained), push_due, st.started_at, now, adm,
                         tuple(st.work), st.replaced)
        self.steps.append(res)
        return res

    def weights_pushed(self, version: int) -> None:
        """The rollout side now serves `version` (the count rule's start bound moves with it)."""
        if version > self.version:
            raise CoreError(f"weights v{version} pushed before step {version - 1} ended")
        self.rollout_version = max(self.rollout_version, version)

    # ---- end of run -----------------------------------------------------------------------------
    def unfinished(self) -> list[GroupRecord]:
        """Groups neither trained nor dropped (the driver records them as not admitted)."""
        return [g for g in self.groups.values() if g.state.open]
