"""A head over replayed executions and the records the test says they ended with, for the event and failure tests."""

from __future__ import annotations

from gyre.sched.cells import Cell
from gyre.sched.state import Role
from support.replay_head import head_for_replay


class LoggedCell(Cell):
    """The cell book as it was before the events: it logs its own role intervals and training
    work, the independent record `cell_stats` (the old computation, kept here as the oracle) reads."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.intervals: list[tuple[str, float, float]] = []
        self.busy_intervals: list[tuple[float, float]] = []
        self.switches = 0

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


def make_head(tmp_path, cfg, clock=None):
    head = head_for_replay(tmp_path, cfg, **({"clock": clock} if clock else {}))
    head.fleet.cells = [LoggedCell(i, i + 1) for i in range(len(head.cells))]
    for c in head.cells:
        c.engine_url = f"http://engine{c.id}"
    return head


def record(eid: str, gid: int, member: int, version: int, t: float, endpoint: str, status: str = "done",
           reward: float | None = None):
    from gyre.traj.record import ExecutionRecord
    from gyre.traj.tree import Segment, TrajectoryTree

    tree = TrajectoryTree()
    for k in range(2):  # two calls, the second 3 s after the first ends
        a = t + 5.0 * k
        tree.add_call([Segment("task", [5, 6, 7, member + 8 + k], "user")], f"a{k}", [3, 4],
                      [20 + member, 30 + k, 31], [-0.5, -1.0, -0.25], agent_role="main", policy_version=version,
                      endpoint=endpoint, t_start=a, t_end=a + 2.0)
    r = float(member % 3) / 2 if reward is None else reward
    return ExecutionRecord(eid, "task", gid, status, r, "tests" if status == "done" else "", tree=tree)
