"""gyre.sched: scheduling policies (pure: observed cluster state -> role decisions).

    spec = RunSpec.from_config(cfg)          # one run spec for every driver
    policy = spec.policy()
    decision = policy.decide(state, now)     # no I/O, no sleeping, no clock

The simulator (gyre.sim) and the live head drive the same objects: the policies and the
coordinator core (`gyre.sched.core.Coordinator`: lifecycle of groups and steps, admission, bursts).
"""

from __future__ import annotations

from gyre.sched.admission import admissible, expired, pick, start_budget
from gyre.sched.core import Coordinator, CoreSpec, GroupState
from gyre.sched.elastic import ElasticPolicy
from gyre.sched.elastic_paper import ElasticPaperPolicy
from gyre.sched.fixed import AsyncPolicy, ColocatePolicy
from gyre.sched.policy import Hints, Policy
from gyre.sched.runspec import SCHEMES, RunSpec, make_policy
from gyre.sched.state import (CellView, ClusterState, Decision, ExecView, GroupView, Role,
                              Switch)

__all__ = ["AsyncPolicy", "CellView", "ClusterState", "ColocatePolicy", "Coordinator", "CoreSpec", "Decision",
           "ElasticPaperPolicy",
           "ElasticPolicy", "ExecView", "GroupState", "GroupView", "Hints", "Policy", "Role", "SCHEMES", "Switch",
           "admissible", "expired", "make_policy", "pick", "RunSpec", "start_budget"]
