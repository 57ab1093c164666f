"""ClusterState.running is the coordinator's running table read without a copy (issue 33 item 4:
a simulated step decides thousands of times); a state someone keeps still shows what it showed."""

from __future__ import annotations

import pickle

from gyre.sched.core import Coordinator, CoreSpec
from gyre.sched.state import CellView, Role

CELLS = (CellView(0, Role.ROLLOUT, 0.0),)


def test_a_kept_state_still_shows_its_running_executions_after_starts_and_ends():
    c = Coordinator(CoreSpec(steps=2, groups_per_step=2, group_size=2, staleness=1))
    (g, h) = c.start_groups(2, 0.0)
    for key in ("a", "b"):
        c.execution_started(g.id, key, 0.0)
    kept = c.cluster_state(1.0, CELLS)
    ids = [v.id for v in kept.running]
    assert len(kept.running) == 2 and kept.running  # counted without a copy

    c.execution_started(h.id, "c", 2.0)
    c.execution_ended("a", 3.0)
    now = c.cluster_state(4.0, CELLS)
    assert [v.id for v in kept.running] == ids and len(kept.running) == 2
    assert len(now.running) == 2 and {v.group for v in now.running} == {g.id, h.id}
    assert kept.running != now.running and kept.running == tuple(kept.running)


def test_an_unchanged_table_gives_equal_states_and_pickles_as_a_tuple():
    c = Coordinator(CoreSpec(steps=1, groups_per_step=1, group_size=1))
    (g,) = c.start_groups(1, 0.0)
    c.execution_started(g.id, "a", 0.0)
    s1, s2 = c.cluster_state(1.0, CELLS), c.cluster_state(1.0, CELLS)
    assert s1 == s2 and hash(s1) == hash(s2)
    back = pickle.loads(pickle.dumps(s1))
    assert back.running == tuple(s1.running) and isinstance(back.running, tuple)
