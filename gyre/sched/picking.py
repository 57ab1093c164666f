"""Which waiting groups the open step takes: the core's pick, in the policy's admission order.

Two ways, both through `gyre.sched.admission.pick` (admissible groups in admission order):

* `keeping_slots` (the default): up to `room` groups; once nothing is left to start (window rule),
  the groups that expire with this step come first and newer ones leave a slot for each such
  group still running, so a straggler is not dropped for a newer group and replaced by one that
  starts from nothing (gyre/sched/core.py's docstring has the measured case).
* `shuffled` (burst_order = shuffle, steps_per_sync > 1): nothing until the groups for the rest of
  the round are in, then `room` of them at random, seeded by step, so a step's position in the
  round says nothing about how long its executions ran.

Pure functions of the core's spec (gyre.sched.core.CoreSpec) and what it holds; the core
(`Coordinator._fill`) calls them.
"""

from __future__ import annotations

import random
from typing import Iterable

from gyre.config import StalenessRule
from gyre.sched.admission import AdmissionKey, expired, pick
from gyre.sched.state import GroupView


def expiring(spec, step: int, version: int) -> bool:
    """A group of this version may train in step `step` but in no later one."""
    s = spec
    return (not expired(step, version, s.staleness, s.steps_per_sync, s.start_version, s.staleness_rule)
            and expired(step + 1, version, s.staleness, s.steps_per_sync, s.start_version, s.staleness_rule))


def keeping_slots(spec, step: int, key: AdmissionKey, waiting: list[GroupView], room: int, still_needed: int,
                  unready_versions: Iterable[int]) -> list[GroupView]:
    """Up to `room` waiting groups in the admission order at version `step`; once nothing is left
    to start (`still_needed` 0), the groups that expire with this step come first and newer ones
    leave a slot for each group still running (`unready_versions`: their versions) that expires
    with it."""
    s = spec
    args = (step, s.staleness, room, key, s.steps_per_sync, s.start_version, s.staleness_rule)
    if s.staleness_rule != StalenessRule.WINDOW or still_needed > 0:
        return pick(waiting, *args)
    kept = sum(1 for v in unready_versions if expiring(s, step, v))
    ok = pick(waiting, step, s.staleness, len(waiting), key, s.steps_per_sync, s.start_version, s.staleness_rule)
    exp = [expiring(s, step, v.version) for v in ok]
    old = [v for v, x in zip(ok, exp) if x][:room]
    new = [v for v, x in zip(ok, exp) if not x]
    return old + new[:max(0, room - len(old) - kept)]


def shuffled(spec, step: int, step_index: int, key: AdmissionKey, waiting: list[GroupView],
             room: int) -> list[GroupView]:
    """burst_order = shuffle: nothing until the groups for the rest of the round are in (the
    first ones in admission order), then `room` of them at random (seeded by the step's index)."""
    s = spec
    left = min(s.steps_per_sync - (step - s.start_version) % s.steps_per_sync, s.steps - step)
    need = room + s.groups_per_step * (left - 1)
    ready = pick(waiting, step, s.staleness, need, key, s.steps_per_sync, s.start_version, s.staleness_rule)
    if len(ready) < need:
        return []
    return random.Random(s.seed * 1_000_003 + step_index).sample(ready, room)
