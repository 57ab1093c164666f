"""Small ended-execution records for the services tests."""

from __future__ import annotations

import math

from gyre.traj.record import ExecutionRecord
from gyre.traj.tree import Segment, TrajectoryTree


def record(eid, gid, status="done", calls=1):
    t = TrajectoryTree()
    for k in range(calls):
        t.add_call([Segment("task", [5, 6, k], "user")], "a", [3, 4], [20, 30], [-0.5, -1.0], agent_role="main",
                   policy_version=0)
    return ExecutionRecord(eid, "t", gid, status, 1.0 if status == "done" else math.nan, "tests", tree=t)
