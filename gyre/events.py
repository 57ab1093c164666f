"""The events of a run, and the one place that turns them into statistics.

A driver (the live head and the simulator) tells what happened as typed events; `RunStats`
folds them into everything a report shows: step rows, lags (group- and token-weighted means and
the worst, in optimizer steps and in rollout syncs), per-cell time (busy rollout, busy train,
switching, paused for a weight push, idle inside a role, failed: they add up to the wall time) and
utilisation. The live
table, `report.json`, `steps.jsonl` and the metrics sink all read these figures, so they are
computed once and agree.

Pure: no clock, no I/O, nothing of a driver. Every time is an argument (seconds, any origin; rows
are relative to `RunStarted.t`). Memory is flat over a run: per-execution facts leave once the
step (or drop) that needed them is folded; per cell only merged busy intervals and role changes
are kept. docs/events.md says who emits and who consumes each event.
"""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Iterable, Union

# statuses (gyre.traj.record.Status words; this module imports nothing of Gyre) of a harness that
# broke: not one that timed out or gave a wrong answer
HARNESS_BROKE = ("failed", "crashed")

# Role names as the cell book spells them (`gyre.sched.state.Role` values); plain strings here so
# that this module and the report depend on nothing of the scheduler.
ROLLOUT, TRAIN, TO_TRAIN, TO_ROLLOUT, FAILED = "rollout", "train", "to_train", "to_rollout", "failed"
ROLES = (ROLLOUT, TRAIN, TO_TRAIN, TO_ROLLOUT, FAILED)
# The time buckets of a cell; with `failed` they add up to the wall time (`bucket_seconds`).
BUCKETS = ("rollout", "train", "switch", "idle")


@dataclass(frozen=True)
class RunStarted:
    t: float            # time zero of the run's rows (cells said hello)
    cells: int


@dataclass(frozen=True)
class CellRoleChanged:
    t: float
    cell: int
    role: str           # one of ROLES; the first one of a cell is its role at the start


@dataclass(frozen=True)
class ExecutionStarted:
    t: float
    execution: str
    group: int
    task: str = ""      # the task's name (per-task reward); "" where a driver has none


@dataclass(frozen=True)
class CallRecorded:
    """One model call of an execution: busy time of the rollout cell that served it."""
    t_start: float
    t_end: float
    cell: int | None    # None: an endpoint no cell owns (never counted)
    execution: str = ""
    n_input: int = 0    # the call's prompt and response tokens (the dashboard's per-call figures)
    n_output: int = 0


@dataclass(frozen=True)
class CellBusy:
    """A stretch of busy time of one cell in its role, told at once: what a driver that has no
    per-cell calls or micro-batches tells (the simulator, whose decode and training are fluid
    pools); RunStats merges it with CallRecorded / MicroBatchDone time alike."""
    t_start: float
    t_end: float
    cell: int
    role: str           # ROLLOUT or TRAIN


@dataclass(frozen=True)
class WeightsPushed:
    """The rollout cells paused while new weights were pushed to them: neither busy nor idle."""
    t_start: float
    t_end: float
    version: int


@dataclass(frozen=True)
class ExecutionEvaluated:
    t: float
    execution: str
    group: int
    status: str
    reward: float | None    # None: no finite reward
    version: int            # oldest policy version that served it
    tokens: float           # unique tokens of its tree
    usable: bool            # finished with a finite reward: it can train
    limit: str | None = None  # the [harness] limit that stopped it ("max_processes"), if one did


@dataclass(frozen=True)
class ExecutionDropped:
    """An ended execution that will not train (the ledger's `admitted: false` line)."""
    t: float
    execution: str
    group: int
    reason: str


@dataclass(frozen=True)
class GroupDropped:
    """A group expired in the admission queue (too stale for any step it could still reach)."""
    t: float
    group: int
    reason: str


@dataclass(frozen=True)
class MicroBatchDone:
    """A train cell finished (ok) or lost (not ok) one micro-batch."""
    t_start: float
    t_end: float
    cell: int
    mb: int
    step: int
    ok: bool
    stats: dict = field(default_factory=dict)   # the trainer's figures: loss, ratio_mean, kl_old, ...


@dataclass(frozen=True)
class GroupLag:
    group: int
    version: int        # oldest optimizer version that served it
    lag_steps: int
    lag_syncs: int
    tokens: float       # training tokens (weight of the token-weighted lag)


@dataclass(frozen=True)
class StepEnded:
    t_start: float              # first group assigned (t_end if none)
    t_end: float
    step: int
    version: int                # optimizer version after it
    groups: tuple[GroupLag, ...]
    micro_batches: tuple = ()
    participants: tuple[int, ...] = ()
    pushed: bool = False
    reduce_s: float = 0.0
    push_s: float = 0.0
    grad_norm: float | None = None
    extra: dict = field(default_factory=dict)  # the driver's further figures of the step, into its row


@dataclass(frozen=True)
class RunEnded:
    t: float
    stopped: bool = False


Event = Union[RunStarted, CellRoleChanged, ExecutionStarted, CallRecorded, CellBusy, ExecutionEvaluated,
              ExecutionDropped, GroupDropped, MicroBatchDone, WeightsPushed, StepEnded, RunEnded]


@dataclass(frozen=True)
class Lag:
    """Staleness of trained groups (the keys of report.json's `lag`)."""
    groups: int = 0
    group_mean_steps: float = 0.0
    token_mean_steps: float = 0.0
    worst_steps: int = 0
    group_mean_syncs: float = 0.0
    token_mean_syncs: float = 0.0
    worst_syncs: int = 0
    tokens: float = 0.0  # the trained groups' tokens (the token means' weight: sessions fold by it)


class _CellBook:
    """One cell's time: role changes and merged busy intervals (few: merging keeps them so)."""

    def __init__(self) -> None:
        self.role: str | None = None
        self.since = 0.0
        self.intervals: list[tuple[str, float, float]] = []
        self.switches = 0
        self.switches_to = {TO_TRAIN: 0, TO_ROLLOUT: 0}
        self.busy: dict[str, list[list[float]]] = {ROLLOUT: [], TRAIN: []}

    def change(self, role: str, t: float) -> None:
        if role == self.role:
            return
        if self.role is not None:
            self.intervals.append((self.role, self.since, t))
            if role in (TO_TRAIN, TO_ROLLOUT):
                self.switches += 1
                self.switches_to[role] += 1
        self.role, self.since = role, t

    def work(self, kind: str, a: float, b: float) -> None:
        if b > a:
            _insert(self.busy[kind], a, b)

    def spans(self, t1: float) -> list[tuple[str, float, float]]:
        open_ = [(self.role, self.since, t1)] if self.role is not None and t1 > self.since else []
        return self.intervals + open_


def _insert(merged: list[list[float]], a: float, b: float) -> None:
    """Add [a, b] to a sorted list of disjoint intervals, merging what it touches."""
    i = bisect.bisect_left(merged, [a, a])
    if i > 0 and merged[i - 1][1] >= a:
        i -= 1
    j = i
    while j < len(merged) and merged[j][0] <= b:
        a, b = min(a, merged[j][0]), max(b, merged[j][1])
        j += 1
    merged[i:j] = [[a, b]]


def _clip(spans: Iterable[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in spans if min(b, hi) > max(a, lo)]


def _split(windows: list[tuple[float, float]], cuts: list[list[float]]) -> tuple[list[tuple[float, float]], float]:
    """The windows less the (sorted, disjoint) cuts, and the seconds cut out of them: with busy
    time as the cuts, the idle gaps inside the windows and the busy seconds. Each window starts
    at its first cut (bisect), so a long simulated run stays linear."""
    out, cut = [], 0.0
    for c, d in windows:
        cur = c
        for k in range(max(0, bisect.bisect_left(cuts, [c, c]) - 1), len(cuts)):
            a, b = cuts[k]
            if a >= d:
                break
            lo, hi = max(a, cur), min(b, d)
            if hi <= lo:
                continue
            if lo > cur:
                out.append((cur, lo))
            cut += hi - lo
            cur = hi
        if d > cur:
            out.append((cur, d))
    return out, cut


def broke(ev: ExecutionEvaluated) -> bool:
    """The harness failed or crashed by itself (not stopped by a [harness] limit the policy's work
    passed): a failure of the harness, never a reward sample (gyre.services.rollout.harness_broke)."""
    return ev.status in HARNESS_BROKE and not ev.limit


class _Window:
    """The executions that ended since the last step row: what a dashboard shows per step."""

    def __init__(self) -> None:
        self.n = self.failed = self.calls = self.n_in = self.n_out = 0
        self.tokens = self.seconds = 0.0

    def add(self, ev: ExecutionEvaluated, run: list | None) -> None:
        self.n += 1
        self.failed += broke(ev)
        self.tokens += ev.tokens
        if run is not None:
            self.seconds += ev.t - run[0]
            self.calls += run[1]
            self.n_in += run[2]
            self.n_out += run[3]

    def figures(self, window_s: float) -> dict:
        n, calls = self.n, self.calls
        return {"executions_ended": n, "harness_failures": self.failed,
                "harness_failure_rate": self.failed / n if n else 0.0,
                "execution_s_mean": self.seconds / n if n else None,
                "execution_tokens_mean": self.tokens / n if n else None,
                "calls_per_execution": calls / n if n else None,
                "call_input_tokens_mean": self.n_in / calls if calls else None,
                "call_output_tokens_mean": self.n_out / calls if calls else None,
                "tokens_per_s": self.tokens / window_s if window_s > 0 else None,
                "executions_per_h": 3600.0 * n / window_s if window_s > 0 else None}


class RunStats:
    """Folds events (in the order they happened) into the figures of a run's report."""

    def __init__(self, t0: float = 0.0, cells: int = 0) -> None:
        self.t0 = t0
        self.t1: float | None = None
        self.stopped = False
        self._cells: dict[int, _CellBook] = {i: _CellBook() for i in range(cells)}
        self._rewards: dict[int, list[float]] = {}        # group -> finite rewards, until trained/dropped
        self._mb: dict[int, dict] = {}                     # micro-batch -> last ok trainer stats, until its step ends
        self._task: dict[int, str] = {}                    # group -> task name, until trained/dropped
        self._running: dict[str, list] = {}                # execution -> [start t, calls, in, out tokens] while it runs
        self._win = _Window()                              # executions ended since the last step row
        self._last_end: float | None = None                # t_end of the last step (the window's start)
        self._pushes: list[list[float]] = []              # merged weight-push pauses (rollout cells)
        self.status_counts: dict[str, int] = {}
        self.limit_counts: dict[str, int] = {}  # executions stopped by a [harness] limit, by its key
        self.harness_broke = 0  # executions whose harness failed or crashed by itself (`broke`)
        self.started = 0
        self.dropped_executions = 0
        self.dropped_reasons: dict[str, int] = {}
        self.groups_dropped = 0
        self.steps: list[dict] = []
        # running sums of the lag of trained groups (flat memory; the same figures as the groups would give)
        self._n = 0
        self._lag_sum = [0, 0]          # steps, syncs
        self._lag_tok = [0.0, 0.0]
        self._tok = 0.0
        self._worst = [0, 0]

    # ---- folding ----------------------------------------------------------------------------
    def apply(self, ev: Event) -> dict | None:
        """Fold one event; a StepEnded answers the step's row (the one `steps.jsonl` gets)."""
        handler = _HANDLERS.get(type(ev))
        if handler is None:
            raise TypeError(f"RunStats.apply: {type(ev).__name__} is not a gyre.events event")
        return handler(self, ev)

    def extend(self, events: Iterable[Event]) -> "RunStats":
        for ev in events:
            self.apply(ev)
        return self

    def _cell(self, i: int) -> _CellBook:
        return self._cells.setdefault(i, _CellBook())

    def _run_started(self, ev: RunStarted) -> None:
        self.t0 = ev.t
        for i in range(ev.cells):
            self._cell(i)

    def _role(self, ev: CellRoleChanged) -> None:
        if ev.role not in ROLES:
            raise ValueError(f"CellRoleChanged: role {ev.role!r} is not one of {ROLES}")
        self._cell(ev.cell).change(ev.role, ev.t)

    def _exec_started(self, ev: ExecutionStarted) -> None:
        self.started += 1
        self._running[ev.execution] = [ev.t, 0, 0, 0]
        if ev.task:
            self._task[ev.group] = ev.task

    def _call(self, ev: CallRecorded) -> None:
        if ev.cell is not None:
            self._cell(ev.cell).work(ROLLOUT, ev.t_start, ev.t_end)
        run = self._running.get(ev.execution)
        if run is not None:
            run[1] += 1
            run[2] += ev.n_input
            run[3] += ev.n_output

    def _busy(self, ev: CellBusy) -> None:
        if ev.role not in (ROLLOUT, TRAIN):
            raise ValueError(f"CellBusy: role {ev.role!r} is not {ROLLOUT!r} or {TRAIN!r}")
        self._cell(ev.cell).work(ev.role, ev.t_start, ev.t_end)

    def _pushed(self, ev: WeightsPushed) -> None:
        if ev.t_end > ev.t_start:
            _insert(self._pushes, ev.t_start, ev.t_end)

    def _evaluated(self, ev: ExecutionEvaluated) -> None:
        self.status_counts[ev.status] = self.status_counts.get(ev.status, 0) + 1
        if ev.limit:
            self.limit_counts[ev.limit] = self.limit_counts.get(ev.limit, 0) + 1
        self.harness_broke += broke(ev)
        self._win.add(ev, self._running.pop(ev.execution, None))
        rewards = self._rewards.setdefault(ev.group, [])
        if ev.usable and ev.reward is not None and math.isfinite(ev.reward):  # a crash's 0 is no sample
            rewards.append(ev.reward)

    def _exec_dropped(self, ev: ExecutionDropped) -> None:
        self.dropped_executions += 1
        self.dropped_reasons[ev.reason] = self.dropped_reasons.get(ev.reason, 0) + 1

    def _group_dropped(self, ev: GroupDropped) -> None:
        self.groups_dropped += 1
        self._rewards.pop(ev.group, None)
        self._task.pop(ev.group, None)

    def _mb_done(self, ev: MicroBatchDone) -> None:
        self._cell(ev.cell).work(TRAIN, ev.t_start, ev.t_end)  # lost work was busy time too
        if ev.ok:
            self._mb[ev.mb] = ev.stats

    def microbatch_stats(self, micro_batches) -> list[dict]:
        """The trainers' figures of these micro-batches (kept until their step ends)."""
        return [self._mb[m] for m in micro_batches if m in self._mb]

    def _step(self, ev: StepEnded) -> dict:
        by_task: dict[str, list[float]] = {}
        for g in ev.groups:
            by_task.setdefault(self._task.pop(g.group, ""), []).extend(self._rewards.get(g.group, []))
        by_task.pop("", None)
        rewards = [r for g in ev.groups for r in self._rewards.pop(g.group, [])]
        st = [self._mb.pop(m) for m in ev.micro_batches if m in self._mb]
        for g in ev.groups:
            self._n += 1
            self._tok += g.tokens
            for i, v in enumerate((g.lag_steps, g.lag_syncs)):
                self._lag_sum[i] += v
                self._lag_tok[i] += v * g.tokens
                self._worst[i] = max(self._worst[i], v)
        row = step_row(ev, self.t0, rewards, by_task, st,
                       self._win.figures(ev.t_end - (self.t0 if self._last_end is None else self._last_end)),
                       {"executions_done": sum(self.status_counts.values()), "executions_running": len(self._running),
                        "stopped_by_limits": dict(self.limit_counts)})
        self._win, self._last_end = _Window(), ev.t_end
        self.steps.append(row)
        return row

    def _run_ended(self, ev: RunEnded) -> None:
        self.t1, self.stopped = ev.t, ev.stopped

    # ---- figures ----------------------------------------------------------------------------
    def lag(self) -> Lag:
        if not self._n:
            return Lag()
        n, tok = self._n, self._tok
        tmean = [(self._lag_tok[i] / tok) if tok > 0 else self._lag_sum[i] / n for i in (0, 1)]
        return Lag(n, self._lag_sum[0] / n, tmean[0], self._worst[0], self._lag_sum[1] / n, tmean[1],
                   self._worst[1], tok)

    def cell_ids(self) -> list[int]:
        return sorted(self._cells)

    def cell_time(self, cell: int, t1: float | None = None) -> dict:
        """Seconds per role and bucket over [t0, t1]: busy_rollout + busy_train + switching +
        pushing + idle + failed = wall (idle: a settled cell with no work, inside its role's time;
        pushing: a rollout cell paused for a weight push, told by WeightsPushed)."""
        t1 = self._end(t1)
        book = self._cell(cell)
        role_s = dict.fromkeys(ROLES, 0.0)
        windows: dict[str, list[tuple[float, float]]] = {ROLLOUT: [], TRAIN: []}
        for role, a, b in book.spans(t1):
            a, b = max(a, self.t0), min(b, t1)
            if b > a:
                role_s[role] += b - a
                if role in windows:
                    windows[role].append((a, b))
        serving, pushing = self._serving(windows[ROLLOUT])
        _, busy_roll = _split(serving, book.busy[ROLLOUT])
        _, busy_train = _split(windows[TRAIN], book.busy[TRAIN])
        wall = t1 - self.t0
        idle = max(0.0, role_s[TRAIN] - busy_train) + max(0.0, role_s[ROLLOUT] - busy_roll - pushing)
        return {"cell": cell, "wall_s": wall, "rollout_s": role_s[ROLLOUT], "train_s": role_s[TRAIN],
                "switching_s": role_s[TO_TRAIN] + role_s[TO_ROLLOUT], "failed_s": role_s[FAILED],
                "pushing_s": pushing, "busy_rollout_s": busy_roll, "busy_train_s": busy_train, "idle_s": idle,
                "switches": book.switches, "switches_to_train": book.switches_to[TO_TRAIN],
                "switches_to_rollout": book.switches_to[TO_ROLLOUT],
                "utilisation": (busy_roll + busy_train) / wall if wall > 0 else 0.0}

    def _serving(self, rollout: list[tuple[float, float]]) -> tuple[list[tuple[float, float]], float]:
        """Rollout time less the weight-push pauses, and the seconds paused."""
        return _split(rollout, self._pushes) if self._pushes else (rollout, 0.0)

    def intervals(self, cell: int, t1: float | None = None) -> list[tuple[str, float, float]]:
        """(role, start, end) in absolute time, the last one closed at t1."""
        return self._cell(cell).spans(self._end(t1))

    def idle_spans(self, cell: int, t1: float | None = None) -> list[tuple[float, float]]:
        """The idle gaps inside the cell's rollout and train time (for the Gantt chart's shading)."""
        t1 = self._end(t1)
        book, out = self._cell(cell), []
        for role in (ROLLOUT, TRAIN):
            windows = _clip(((a, b) for r, a, b in book.spans(t1) if r == role), self.t0, t1)
            if role == ROLLOUT:
                windows = self._serving(windows)[0]
            out += _split(windows, book.busy[role])[0]
        return sorted(out)

    def _end(self, t1: float | None) -> float:
        if t1 is not None:
            return t1
        if self.t1 is None:
            raise ValueError("RunStats: pass t1 (the run has not ended)")
        return self.t1


_HANDLERS = {RunStarted: RunStats._run_started, CellRoleChanged: RunStats._role,
             ExecutionStarted: RunStats._exec_started, CallRecorded: RunStats._call, CellBusy: RunStats._busy,
             ExecutionEvaluated: RunStats._evaluated, ExecutionDropped: RunStats._exec_dropped,
             GroupDropped: RunStats._group_dropped, MicroBatchDone: RunStats._mb_done,
             WeightsPushed: RunStats._pushed,
             StepEnded: RunStats._step, RunEnded: RunStats._run_ended}


# The trainer's per-micro-batch figures a step row averages; each is a mean over the micro-batch's
# target tokens, so the step's is the mean weighted by targets (a micro-batch of 3 targets counts
# three times one of 1), as gyre.train.step_stats.merge does across a cell's ranks.
TARGET_MEANS = ("ratio_mean", "clip_frac", "is_weight_mean", "entropy", "moe_aux_loss")


def target_mean(stats: list[dict], key: str) -> float | None:
    """`key`'s mean over micro-batches weighted by their `targets` (None: no micro-batch has it;
    an unweighted mean only where none says its targets)."""
    have = [(x[key], x.get("targets") or 0) for x in stats if x.get(key) is not None]
    if not have:
        return None
    w = sum(t for _, t in have)
    return sum(v * t for v, t in have) / w if w else statistics.fmean(v for v, _ in have)


def step_row(ev: StepEnded, t0: float, rewards: list[float], by_task: dict[str, list[float]], mb_stats: list[dict],
             window: dict, counts: dict) -> dict:
    """The step row: the one builder of what the console line, steps.jsonl, report.json,
    metrics.jsonl, TensorBoard and W&B show of a step (a new figure is one line here, or in the
    driver's `ev.extra`, plus its test).

    Every mean over tokens is weighted by target tokens: the trainer's figures (TARGET_MEANS:
    ratio, clip fraction, IS weight, entropy, MoE aux loss) over the step's micro-batches, and
    `loss_per_target` is the summed loss over the summed targets; the lag's `staleness_token_mean`
    is weighted by the groups' training tokens. Means over executions or groups (reward,
    `staleness_mean`) weigh each alike. `ev.extra` adds what only the driver knows (the
    train/inference mismatch summary, the token audit, replaced groups, the learning rate)."""
    lag = [g.lag_steps for g in ev.groups]
    lag_sync = [g.lag_syncs for g in ev.groups]
    toks = [g.tokens for g in ev.groups]
    loss = sum(x.get("loss", 0.0) for x in mb_stats)
    targets = sum(x.get("targets") or 0 for x in mb_stats)
    kls = [x["kl_old"] for x in mb_stats if x.get("kl_old") is not None]
    trainer = {k: target_mean(mb_stats, k) for k in TARGET_MEANS}
    if trainer["moe_aux_loss"] is None:  # MoE models only
        del trainer["moe_aux_loss"]
    return {"step": ev.step, "version": ev.version, "groups": len(ev.groups),
            "micro_batches": len(ev.micro_batches), "participants": list(ev.participants),
            "reward_mean": statistics.fmean(rewards) if rewards else None, "reward_n": len(rewards),
            "reward_std": statistics.pstdev(rewards) if rewards else None,
            "reward_by_task": {t: statistics.fmean(r) for t, r in sorted(by_task.items()) if r},
            "staleness_mean": statistics.fmean(lag) if lag else 0, "staleness_max": max(lag, default=0),
            "staleness_token_mean": sum(a * b for a, b in zip(lag, toks)) / sum(toks) if sum(toks) else 0,
            "lag_syncs_mean": statistics.fmean(lag_sync) if lag_sync else 0,
            "lag_syncs_max": max(lag_sync, default=0), "pushed": ev.pushed,
            # the loss of a GRPO step is ~0 by construction; what moves is the surrogate's scale
            "loss": loss, "loss_per_target": loss / targets if targets else None, **trainer,
            "kl_old_max": max(kls, default=None), "grad_norm": ev.grad_norm,
            "reduce_s": ev.reduce_s, "push_s": ev.push_s, "t_start": ev.t_start - t0, "t_end": ev.t_end - t0,
            **window, **counts, **ev.extra}


def bucket_seconds(cell: dict) -> dict[str, float]:
    """A `cell_time` row in the BUCKETS (a push pause is booked with switching: the cell cannot
    serve); with `failed_s` they add up to the wall time."""
    return {"rollout": cell["busy_rollout_s"], "train": cell["busy_train_s"],
            "switch": cell["switching_s"] + cell.get("pushing_s", 0.0), "idle": cell["idle_s"]}  # (older reports: no pushes)


def summarise(events: Iterable[Event], t1: float | None = None) -> dict:
    """Step rows, lag and per-cell time of a whole event list (the report's shared schema)."""
    s = RunStats().extend(events)
    return {"steps": s.steps, "lag": asdict(s.lag()), "cells": [s.cell_time(c, t1) for c in s.cell_ids()],
            "executions": dict(s.status_counts)}
