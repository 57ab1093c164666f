"""A real Head with the real core, ledger, shards and materializer; only its I/O edges are absent:
no cells to message (commands are answered by the test) and no harness (the test says how
executions ended). The rollout service is constructed, not started: it holds the shard writer."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

from gyre.config import GyreConfig
from gyre.head import Head
from gyre.sched.core import Coordinator, CoreSpec, fifo_key
from gyre.services.fleet import WeightPaths
from gyre.services.rollout import RolloutService
from gyre.services.training import Reduced
from gyre.traj.select import SelectionSpec

IDENTITY = {"model_hash": "m" * 8, "tokenizer_hash": "t" * 8}
NOTHING_REDUCED = Reduced([], [], 0.0)  # a step the test trained itself


def head_for_replay(tmp_path: Path, spec: CoreSpec, key=fifo_key, *, per_shard: int | None = None,
                    clock=time.time, engine_urls: bool = False) -> Head:
    cfg = GyreConfig()
    cfg.run.dir, cfg.run.steps, cfg.run.groups_per_step = str(tmp_path), spec.steps, spec.groups_per_step
    cfg.harness.group_size = spec.group_size
    cfg.sched.staleness, cfg.sched.steps_per_sync = spec.staleness, spec.steps_per_sync
    if per_shard is not None:
        cfg.store.executions_per_shard = per_shard
    head = Head(cfg, None, 2, clock=clock)
    head.attach(Coordinator(spec, key), [SimpleNamespace(name="task")], WeightPaths(tmp_path, tmp_path, tmp_path),
                SelectionSpec.from_config(cfg.selection),
                RolloutService(cfg, None, tmp_path, IDENTITY, tmp_path / "shards"))
    head.ledger.open()
    head._spawn = lambda coro, name=None: coro.close()  # executions are played by the test
    if engine_urls:
        for c in head.cells:
            c.engine_url = f"http://engine{c.id}"
    return head


def set_clock(head: Head, clock) -> None:
    """The head and its services read one clock (the test's)."""
    head.clock = head.fleet.clock = head.training.clock = head.ledger.clock = clock
