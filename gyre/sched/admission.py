"""The staleness rules, shared by every policy and both drivers (through the coordinator core).

Versions count optimizer steps. With ``steps_per_sync`` = b > 1 rollout weights are pushed once
per round of b steps, so a group has two lags: in optimizer steps (``step - version``) and in
rollout syncs (``sync(step) - sync(version)``, ``sync(v) = (v - base) // b``). The bound k is in
syncs (with b = 1 both units agree).

Two rules bound staleness:

* ``window`` (the hard window): a group served by version v trains in step s only if its sync lag
  is within 0..k; a group past that is dropped (recorded as not admitted) and replaced. Starts are
  bounded so that no more than (k + 1) rounds of groups are open at once.
* ``count`` (AReaL's rule): while rollout sync r serves, at most (r + k + 1) x groups-per-round
  groups have been started; nothing is dropped for staleness, since the start bound already keeps
  the group-weighted lag within k when groups train in start order.
"""

from __future__ import annotations

from typing import Callable, Iterable

from gyre.config import StalenessRule
from gyre.sched.state import ClusterState, GroupView

AdmissionKey = Callable[[GroupView], tuple]
RULES = tuple(r.value for r in StalenessRule)


def sync_of(version: int, steps_per_sync: int = 1, base: int = 0) -> int:
    """Rollout sync (weight push) that serves optimizer version `version`."""
    return (version - base) // steps_per_sync


def sync_lag(step: int, version: int, steps_per_sync: int = 1, base: int = 0) -> int:
    return sync_of(step, steps_per_sync, base) - sync_of(version, steps_per_sync, base)


def admissible(step: int, version: int, staleness: int, steps_per_sync: int = 1, base: int = 0,
               rule: StalenessRule = StalenessRule.WINDOW) -> bool:
    if version > step:  # never train a version before it exists
        return False
    return rule == StalenessRule.COUNT or sync_lag(step, version, steps_per_sync, base) <= staleness


def expired(step: int, version: int, staleness: int, steps_per_sync: int = 1, base: int = 0,
            rule: StalenessRule = StalenessRule.WINDOW) -> bool:
    """True once step has moved past what this version may train in: record as not admitted."""
    return rule == StalenessRule.WINDOW and sync_lag(step, version, steps_per_sync, base) > staleness


def window_budget(groups_per_step: int, staleness: int, groups_open: int, steps_per_sync: int = 1,
                  rollout_sync: int = 0, step: int = 0) -> int:
    """Window rule: start no group that could not train within the bound even if every open group
    ended now. A group started while sync r serves trains at the latest in the last step of round
    r + k; the steps from the open one (`step`, counted from the run's base) up to there hold
    Q slots each, and the open groups take theirs first. With b = 1 and the newest weights
    serving (r = step) this is the familiar Q x (k + 1) - open."""
    last = (rollout_sync + staleness + 1) * steps_per_sync  # first step past the window
    return max(0, groups_per_step * (last - step) - groups_open)


def count_budget(groups_per_round: int, staleness: int, rollout_sync: int, groups_started: int) -> int:
    """Count rule: at rollout sync r at most (r + k + 1) x groups-per-round started in all."""
    return max(0, groups_per_round * (rollout_sync + staleness + 1) - groups_started)


def start_budget(state: ClusterState) -> int:
    """Groups that may start now (the coordinator core computes it under the run's rule)."""
    if state.starts_blocked:
        return 0
    if state.starts_allowed is not None:
        return state.starts_allowed
    return max(0, state.groups_per_step * (state.staleness + 1) - state.groups_open)


def fifo_key(g: GroupView) -> tuple:
    """Paper-style order: first evaluated, first trained."""
    return (g.ready_at, g.id)


def oldest_version_key(g: GroupView) -> tuple:
    """Train the groups closest to expiry first, so fewer are dropped as stale."""
    return (g.version, g.ready_at, g.id)


def pick(groups: Iterable[GroupView], step: int, staleness: int, room: int,
         key: AdmissionKey, steps_per_sync: int = 1, base: int = 0,
         rule: StalenessRule = StalenessRule.WINDOW) -> list[GroupView]:
    """Up to `room` admissible groups for `step`, in the policy's admission order."""
    ok = [g for g in groups if admissible(step, g.version, staleness, steps_per_sync, base, rule)]
    ok.sort(key=key)
    return ok[:max(0, room)]
