"""What one simulated run reports."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from gyre.events import BUCKETS, bucket_seconds

# A simulated run reports in the live run's schema: its step rows and per-cell time are
# gyre.events.RunStats's, folded from the events the simulator told (docs/events.md).


@dataclass
class SimResult:
    label: str
    scheme: str
    staleness: int
    nodes: int
    cells: int
    cell_size: int
    gpus_per_cell: int
    steps: int
    groups_per_step: int
    group_size: int
    makespan_s: float
    lower_bound_s: float
    cell_stats: list[dict]                # RunStats.cell_time per cell (report.json's `cells`)
    step_stats: list[dict]                # RunStats step rows (steps.jsonl's rows)
    executions_started: int
    executions_trained: int
    not_admitted: dict[str, int]          # reason -> executions
    unserved_s: float                     # time with running executions and no rollout cell
    events: int
    decisions: int                        # decision points (a starts_budget_only policy: the core answers)
    wall_s: float
    mean_rollout_h: float = 0.0           # observed wall time of an execution (paper: 1.93 h)
    mean_query_h: float = 0.0             # observed wall time of a group's slowest (paper: 2.96 h)
    query_ge_4h_share: float = 0.0        # share of groups whose slowest took >= 4 h (paper: 9.51%)
    staleness_rule: str = "window"
    steps_per_sync: int = 1
    preset: str = ""
    # Lags of trained groups (RunStats.lag(), report.json's `lag`): optimizer steps and rollout syncs.
    lag: dict = field(default_factory=dict)
    dropped_groups: int = 0               # groups dropped as stale (and replaced)
    # Regime: share of the makespan where rollout is the critical path (no training work admitted
    # while executions run or await evaluation), and idle shares of train- and rollout-role time.
    rollout_critical_share: float = 0.0
    trainer_idle_share: float = 0.0
    rollout_idle_share: float = 0.0
    mean_batch: float = 0.0               # calls per busy replica, as a call sees it
    model_wait_share: float = 0.0         # share of an execution's time spent waiting on the model
    evictions: int = 0                    # prefixes evicted for KV capacity
    reprefills: int = 0                   # calls that re-prefilled a lost context
    # "Rollout masks training with X% slack": mean over steps of 1 - the step's training
    # cell-seconds / the rollout side's spare cell-seconds in its rollout window (step start ->
    # batch complete; spare = cells the calls in flight do not need at the decode knee). Negative:
    # the step's training does not fit in the spare capacity. None where a step has no window of its
    # own (staleness > 0 or several steps per sync: its batch may be complete when it opens).
    slack: float | None = 0.0
    async_rollout_cells: int = 0          # scheme A: its rollout pool
    async_given_up: dict = field(default_factory=dict)  # A's split search: splits given up -> hours simulated then
    bound_basis: str = ""                 # what the lower bound was computed on
    # Not serialised: per-execution outcome and the timelines behind the plots (RunStats.intervals
    # as (start, end, role), and RunStats.idle_spans when recorded).
    outcomes: dict[int, tuple] = field(default_factory=dict, repr=False)
    roles: list[list[tuple[float, float, str]]] = field(default_factory=list, repr=False)
    idle: list[list[tuple[float, float]]] = field(default_factory=list, repr=False)

    @property
    def hours(self) -> float:
        return self.makespan_s / 3600.0

    @property
    def lower_bound_hours(self) -> float:
        return self.lower_bound_s / 3600.0

    def bucket_total(self, bucket: str) -> float:
        """Cell-seconds in one of BUCKETS over all cells."""
        if bucket not in BUCKETS:
            raise ValueError(f"bucket {bucket!r} is not one of {BUCKETS}")
        return sum(bucket_seconds(c)[bucket] for c in self.cell_stats)

    def gpu_hours(self, *buckets: str) -> float:
        return sum(self.bucket_total(b) for b in buckets) * self.gpus_per_cell / 3600.0

    @property
    def utilisation(self) -> float:
        total = self.makespan_s * self.cells
        return (self.bucket_total("rollout") + self.bucket_total("train")) / total if total else 0.0

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("outcomes", "roles", "idle")}
        d.update(hours=round(self.hours, 3), lower_bound_hours=round(self.lower_bound_hours, 3),
                 ratio_to_lower_bound=round(self.makespan_s / self.lower_bound_s, 4) if self.lower_bound_s else None,
                 utilisation=round(self.utilisation, 4),
                 gpu_hours_used=round(self.gpu_hours("rollout", "train"), 1),
                 gpu_hours_wasted=round(self.gpu_hours("switch", "idle"), 1),
                 switches=sum(c["switches"] for c in self.cell_stats))
        return d
