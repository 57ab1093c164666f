"""The head's book of cells: role, since when, what each is doing, and where its time went.

Time accounting samples nothing: every role change and every start/end of work is an event with
a timestamp, so role + switching + idle add up to the wall time of the run for each cell.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gyre.sched.state import CellView, Role


@dataclass
class Cell:
    id: int
    rank: int
    role: Role = Role.ROLLOUT
    since: float = 0.0
    engine_url: str = ""
    old_urls: list[str] = field(default_factory=list)   # engines it ran before a restart
    hostname: str = ""
    last_seen: float = 0.0
    step_mbs: set[int] = field(default_factory=set)     # micro-batches it trained in the open step
    mb_in_flight: int | None = None
    switches: int = 0
    intervals: list[tuple[str, float, float]] = field(default_factory=list)  # (role, start, end)
    busy_intervals: list[tuple[float, float]] = field(default_factory=list)  # training work
    switch_phases: list[dict] = field(default_factory=list)

    def view(self) -> CellView:
        return CellView(self.id, self.role, self.since)

    def set_role(self, role: Role, now: float) -> None:
        if role is self.role:
            return
        self.intervals.append((self.role.value, self.since, now))
        if role in (Role.TO_TRAIN, Role.TO_ROLLOUT):
            self.switches += 1
        self.role, self.since = role, now

    def close(self, now: float) -> None:
        self.intervals.append((self.role.value, self.since, now))
        self.since = now


def cell_stats(cell: Cell, t0: float, t1: float, rollout_busy: list[tuple[float, float]]) -> dict:
    """Seconds in each role, switching, and idle (a settled cell with no work) over [t0, t1]."""
    role_s = {r.value: 0.0 for r in Role}
    for role, a, b in cell.intervals:
        a, b = max(a, t0), min(b, t1)
        if b > a:
            role_s[role] += b - a
    busy_train = _overlap(cell.busy_intervals, [(a, b) for r, a, b in cell.intervals if r == "train"])
    busy_roll = _overlap(rollout_busy, [(a, b) for r, a, b in cell.intervals if r == "rollout"])
    switching = role_s["to_train"] + role_s["to_rollout"]
    wall = t1 - t0
    idle = max(0.0, role_s["train"] - busy_train) + max(0.0, role_s["rollout"] - busy_roll)
    return {"cell": cell.id, "hostname": cell.hostname, "wall_s": wall, "rollout_s": role_s["rollout"],
            "train_s": role_s["train"], "switching_s": switching, "failed_s": role_s["failed"],
            "busy_rollout_s": busy_roll, "busy_train_s": busy_train, "idle_s": idle,
            "switches": cell.switches, "utilisation": (busy_roll + busy_train) / wall if wall > 0 else 0.0}


def _overlap(work: list[tuple[float, float]], windows: list[tuple[float, float]]) -> float:
    total = 0.0
    for a, b in _merge(work):
        for c, d in windows:
            lo, hi = max(a, c), min(b, d)
            if hi > lo:
                total += hi - lo
    return total


def _merge(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]
