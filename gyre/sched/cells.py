"""The head's book of cells: role, since when, and what each is doing now.

Where each cell's time went is not kept here: every role change and every stretch of work is an
event (gyre.events), and `RunStats` folds them into per-cell time, once, for live and simulated
runs alike.
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
    switch_phases: list[dict] = field(default_factory=list)

    def view(self) -> CellView:
        return CellView(self.id, self.role, self.since)

    def set_role(self, role: Role, now: float) -> None:
        if role is not self.role:
            self.role, self.since = role, now
