"""gyre.sched: scheduling policies (pure: observed cluster state -> role decisions).

    policy = make_policy("E", staleness=0, hints=Hints(...))
    decision = policy.decide(state, now)     # no I/O, no sleeping, no clock

The simulator (gyre.sim) and the live head drive the same objects: the policies and the
coordinator core (`gyre.sched.core.Coordinator`: lifecycle of groups and steps, admission, bursts).
"""

from __future__ import annotations

from gyre.config import Scheme
from gyre.sched.admission import admissible, expired, pick, start_budget
from gyre.sched.core import Coordinator, CoreSpec, GroupState, LagStats
from gyre.sched.elastic import ElasticPolicy
from gyre.sched.elastic_paper import ElasticPaperPolicy
from gyre.sched.fixed import AsyncPolicy, ColocatePolicy
from gyre.sched.policy import Hints, Policy
from gyre.sched.state import (CellView, ClusterState, Decision, ExecView, GroupView, Role,
                              Switch)

SCHEMES = tuple(s.value for s in Scheme)


def policy_from_config(cfg, cell_scale: float = 1.0) -> Policy:
    """The policy a live run uses: scheme, staleness and costs from ``[sched]`` (a GyreConfig)."""
    s = cfg.sched
    hints = Hints(to_train_s=s.to_train_s, to_rollout_s=s.to_rollout_s, push_s=s.push_s,
                  execs_per_cell=s.execs_per_cell, min_dwell_s=s.min_dwell_s, cell_scale=cell_scale,
                  calls_per_cell=s.calls_per_cell,
                  train_tokens_per_s=cfg.sim.train_tokens_per_s, eval_s=cfg.sim.eval_s)
    return make_policy(s.scheme, s.staleness, hints, rollout_cells=max(1, s.rollout_cells_async))


def make_policy(scheme: str, staleness: int = 0, hints: Hints | None = None,
                rollout_cells: int = 1) -> Policy:
    """`rollout_cells` is the rollout pool of scheme A; the others ignore it."""
    if scheme == Scheme.E:
        return ElasticPolicy(staleness, hints)
    if scheme == Scheme.E_PAPER:
        return ElasticPaperPolicy(staleness, hints)
    if scheme == Scheme.A:
        return AsyncPolicy(staleness, hints, rollout_cells)
    if scheme == Scheme.C:
        return ColocatePolicy(staleness, hints)
    raise ValueError(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")


__all__ = ["AsyncPolicy", "CellView", "ClusterState", "ColocatePolicy", "Coordinator", "CoreSpec", "Decision",
           "ElasticPaperPolicy",
           "ElasticPolicy", "ExecView", "GroupState", "GroupView", "Hints", "LagStats", "Policy", "Role", "SCHEMES", "Switch",
           "admissible", "expired", "make_policy", "pick", "policy_from_config", "start_budget"]
