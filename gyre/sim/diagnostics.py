"""What a simulated run reports beyond its events: the regime diagnostics the run loop
accumulates as its clock moves, the cells' busy stretches it tells, and the SimResult built at
the end.

The run loop (gyre.sim.simulator) adds to `Diagnostics`' figures inline (they are read and
written at every advance of the clock, where a call would cost more than the arithmetic);
`BusyStretches` is asked only when what the busy set depends on changed.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Callable

from gyre.config import StalenessRule
from gyre.events import ROLLOUT, TRAIN, CellBusy
from gyre.sched.state import Role
from gyre.sim.bound import lower_bound_trained
from gyre.sim.result import SimResult


class Diagnostics:
    """The run's regime figures: slack of each step's rollout window, time no cell served,
    rollout on the critical path, the call-weighted batch, executions' time."""
    __slots__ = ("knee", "win_spare", "win_open", "slacks", "unserved", "exec_time", "execs_ended",
                 "tool_time", "crit_roll", "load_num", "load_den")

    def __init__(self, workload, cluster) -> None:
        # slack: per step, the share of the rollout side's spare capacity during the step's rollout
        # window (step start -> batch complete) that the step's training does not need; spare =
        # cells the calls in flight do not need at the decode knee (ClusterModel.calls_per_cell)
        ctx = [e.context_tokens / 2 for i in range(4) for e in workload.group(i).execs]
        self.knee = cluster.calls_per_cell(sum(ctx) / len(ctx)) if ctx else 1.0
        self.win_spare = 0.0
        self.win_open = True
        self.slacks: list[float] = []
        self.unserved = 0.0      # seconds executions ran with no rollout cell to serve them
        self.exec_time = 0.0     # wall seconds of ended executions (their observed durations)
        self.execs_ended = 0
        self.tool_time = 0.0     # tool seconds of ended executions
        self.crit_roll = 0.0     # rollout on the critical path
        self.load_num = self.load_den = 0.0  # call-weighted load per serving cell

    def execution_ended(self, took: float, tool_s: float) -> None:
        self.exec_time += took
        self.tool_time += tool_s
        self.execs_ended += 1

    def batch_complete(self, work_cell_s: float) -> None:
        """The open step's batch is complete: its rollout window closes (`work_cell_s`: the
        cell-seconds its training takes)."""
        if self.win_spare > 0:
            self.slacks.append(1.0 - work_cell_s / self.win_spare)
        self.win_open = False

    def step_ended(self) -> None:
        self.win_spare, self.win_open = 0.0, True

    def figures(self, end: float, exact: bool) -> dict:
        """SimResult's diagnostic fields (a step's rollout window is defined only when each step
        rolls out its own batch: `exact`)."""
        return dict(
            unserved_s=self.unserved, mean_rollout_h=self.exec_time / max(1, self.execs_ended) / 3600,
            rollout_critical_share=self.crit_roll / end if end else 0.0,
            mean_batch=self.load_num / self.load_den if self.load_den else 0.0,
            model_wait_share=1.0 - self.tool_time / self.exec_time if self.exec_time else 0.0,
            slack=(sum(self.slacks) / len(self.slacks) if self.slacks else 0.0) if exact else None)


class BusyStretches:
    """Each cell's bucket (0: serving calls, 1: training, 2: switching or pushing, 3: idle) for
    the configuration the run loop is in; a busy stretch (bucket 0 or 1) is told as `CellBusy`
    when it ends."""
    __slots__ = ("role", "emit", "key", "a", "since", "_cache")

    def __init__(self, role: list, emit: Callable) -> None:
        """`role`: the simulator's list of cell roles (the same list); `emit`: tells an event."""
        self.role, self.emit = role, emit
        self.key: tuple | None = None  # (roles_rev, busy rollout cells, pushing, training) of `a`
        self.a: tuple[int, ...] | None = None  # the bucket of every cell since the last change
        self.since = [0.0] * len(role)         # start of a cell's open busy stretch
        self._cache: dict = {}

    def update(self, key: tuple, now: float) -> None:
        """The run loop's configuration is `key` from `now` on."""
        self.key = key
        a = self.assignment(*key)
        if a is not self.a:
            self.changed(a, now)

    def assignment(self, roles_rev: int, busy_r: int, pushing: bool, training: bool) -> tuple[int, ...]:
        """Bucket index of every cell for this configuration (cached: few distinct ones occur)."""
        key = (roles_rev, busy_r, pushing, training)
        a = self._cache.get(key)
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
            a = self._cache[key] = tuple(out)
        return a

    def changed(self, a: tuple[int, ...], now: float) -> None:
        """The busy set changed at now: a cell's busy stretch that ends is told; one that
        begins is opened."""
        old = self.a
        for i, b in enumerate(a):
            was = old[i] if old is not None else -1
            if b == was:
                continue
            if was == 0 or was == 1:
                self.emit(CellBusy(self.since[i], now, i, ROLLOUT if was == 0 else TRAIN))
            if b == 0 or b == 1:
                self.since[i] = now
        self.a = a

    def close(self, end: float) -> None:
        """The run ended: the busy stretches still open are told."""
        for i, b in enumerate(self.a or ()):
            if (b == 0 or b == 1) and end > self.since[i]:
                self.emit(CellBusy(self.since[i], end, i, ROLLOUT if b == 0 else TRAIN))


def sim_result(sim, wall: float) -> SimResult:
    """The figures of a finished run of `sim` (a gyre.sim.simulator.Simulator, its events all
    told): cells' time and step rows from its RunStats, the lower bound on the work it trained,
    its diagnostics."""
    end, st, c, p, spec = sim.now, sim.stats, sim.c, sim.p, sim.core.spec
    cells = [st.cell_time(i) for i in st.cell_ids()]
    roll, train = sum(x["rollout_s"] for x in cells), sum(x["train_s"] for x in cells)
    roll_idle = sum(max(0.0, x["rollout_s"] - x["busy_rollout_s"] - x["pushing_s"]) for x in cells)
    train_idle = sum(max(0.0, x["train_s"] - x["busy_train_s"]) for x in cells)
    exact = p.staleness == 0 and spec.steps_per_sync == 1
    window = spec.staleness_rule == StalenessRule.WINDOW
    arrival = window and spec.steps_per_sync == 1  # versions bound which groups each step trains
    bound = lower_bound_trained(sim.w, c, sim.trained_by_step, arrival=arrival, max_open=(
        spec.steps_per_sync * spec.groups_per_step * (p.staleness + 1) if window else 0), staleness=p.staleness)
    done = [g.slowest for g in sim.groups.values() if g.left == 0]
    return SimResult(
        label=p.label, scheme=p.scheme, staleness=p.staleness, nodes=c.nodes,
        cells=c.cells, cell_size=c.cell_nodes, gpus_per_cell=c.gpus_per_cell, steps=spec.steps,
        groups_per_step=spec.groups_per_step, group_size=sim.w.group_size, makespan_s=end,
        lower_bound_s=bound, cell_stats=cells, step_stats=st.steps, executions_started=sim.next_exec,
        executions_trained=sum(1 for o in sim.outcomes.values() if o[0] == "trained"),
        not_admitted=dict(st.dropped_reasons), events=sim.n_events, decisions=sim.decisions, wall_s=wall,
        mean_query_h=_mean(done) / 3600, query_ge_4h_share=_mean([float(s >= 4 * 3600) for s in done]),
        staleness_rule=spec.staleness_rule, steps_per_sync=spec.steps_per_sync,
        lag=asdict(st.lag()), dropped_groups=st.groups_dropped,
        trainer_idle_share=train_idle / train if train else 0.0,
        rollout_idle_share=roll_idle / roll if roll else 0.0,
        evictions=sim.cache.evictions, reprefills=sim.cache.reprefills,
        bound_basis=("the groups actually trained: work" + (", open-group concurrency" if window else "")
                     + (f", per-step arrival at staleness {p.staleness}" if arrival else "")),
        outcomes=sim.outcomes, **sim.diag.figures(end, exact),
        roles=[[(a, b, role) for role, a, b in st.intervals(i) if b > a] for i in st.cell_ids()],
        idle=[st.idle_spans(i) if sim.s.record else [] for i in st.cell_ids()])


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0
