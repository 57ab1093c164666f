"""The staleness rule, shared by every policy and both drivers.

A group whose oldest serving version is v may train in step s only if v <= s <= v + k. Rollouts
for later steps may start early, but never so many that they could not all train within the
bound: at most Q * (k + 1) groups are open (started, not yet trained or dropped) at once.
"""

from __future__ import annotations

from typing import Callable, Iterable

from gyre.sched.state import ClusterState, GroupView

AdmissionKey = Callable[[GroupView], tuple]


def admissible(step: int, version: int, staleness: int) -> bool:
    return version <= step <= version + staleness


def expired(step: int, version: int, staleness: int) -> bool:
    """True once step has moved past what this version may train in: record as not admitted."""
    return step - version > staleness


def start_budget(state: ClusterState) -> int:
    """Groups that may start now without any of them being bound to break staleness."""
    if state.starts_blocked:
        return 0
    return max(0, state.groups_per_step * (state.staleness + 1) - state.groups_open)


def fifo_key(g: GroupView) -> tuple:
    """Paper-style order: first evaluated, first trained."""
    return (g.ready_at, g.id)


def oldest_version_key(g: GroupView) -> tuple:
    """Train the groups closest to expiry first, so fewer are dropped as stale."""
    return (g.version, g.ready_at, g.id)


def pick(groups: Iterable[GroupView], step: int, staleness: int, room: int,
         key: AdmissionKey) -> list[GroupView]:
    """Up to `room` admissible groups for `step`, in the policy's admission order."""
    ok = [g for g in groups if admissible(step, g.version, staleness)]
    ok.sort(key=key)
    return ok[:max(0, room)]
