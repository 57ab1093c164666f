"""gyre.sched: scheduling policies (pure: observed cluster state -> role decisions).

    policy = make_policy("E", staleness=0, hints=Hints(...))
    decision = policy.decide(state, now)     # no I/O, no sleeping, no clock

The simulator (gyre.sim) and the live coordinator drive the same objects.
"""

from __future__ import annotations

from gyre.sched.admission import admissible, expired, pick, start_budget
from gyre.sched.elastic import ElasticPolicy
from gyre.sched.elastic_plus import ElasticPlusPolicy
from gyre.sched.fixed import AsyncPolicy, ColocatePolicy
from gyre.sched.policy import Hints, Policy
from gyre.sched.state import (CellView, ClusterState, Decision, ExecView, GroupView, Role,
                              Switch)

SCHEMES = ("E", "E+", "A", "C")


def make_policy(scheme: str, staleness: int = 0, hints: Hints | None = None,
                rollout_cells: int = 1) -> Policy:
    """`rollout_cells` is the rollout pool of scheme A; the others ignore it."""
    if scheme == "E":
        return ElasticPolicy(staleness, hints)
    if scheme == "E+":
        return ElasticPlusPolicy(staleness, hints)
    if scheme == "A":
        return AsyncPolicy(staleness, hints, rollout_cells)
    if scheme == "C":
        return ColocatePolicy(staleness, hints)
    raise ValueError(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")


__all__ = ["AsyncPolicy", "CellView", "ClusterState", "ColocatePolicy", "Decision", "ElasticPlusPolicy",
           "ElasticPolicy", "ExecView", "GroupView", "Hints", "Policy", "Role", "SCHEMES", "Switch",
           "admissible", "expired", "make_policy", "pick", "start_budget"]
