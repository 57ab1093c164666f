"""A real Head with the real core, ledger, shards and materializer; only its I/O edges are absent:
no cells to message (commands are answered by the test) and no harness (the test says how
executions ended). The rollout service is constructed, not started: it holds the shard writer."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

from gyre.config import GyreConfig
from gyre.head import Head
from gyre.services.fleet import WeightPaths
from gyre.services.rollout import RolloutService
from gyre.services.training import StepReduced
from gyre.traj.select import SelectionSpec

IDENTITY = {"model_hash": "m" * 8, "tokenizer_hash": "t" * 8}
NOTHING_REDUCED = StepReduced([], [], 0.0)  # a step the test trained itself


def run_config(tmp_path: Path, steps: int, q: int, g: int, k: int = 0, b: int = 1, *,
               per_shard: int | None = None, **sched) -> GyreConfig:
    """The configuration of a small run in `tmp_path`: `steps` steps of `q` groups of `g`, staleness
    `k`, `b` steps per sync; `sched` sets more [sched] keys."""
    cfg = GyreConfig()
    cfg.run.dir, cfg.run.steps, cfg.run.groups_per_step = str(tmp_path), steps, q
    cfg.harness.group_size = g
    cfg.sched.staleness, cfg.sched.steps_per_sync = k, b
    for name, value in sched.items():
        setattr(cfg.sched, name, value)
    if per_shard is not None:
        cfg.store.executions_per_shard = per_shard
    return cfg


def head_for_replay(tmp_path: Path, cfg: GyreConfig, *, clock=time.time, engine_urls: bool = False) -> Head:
    """The head of `cfg`, its policy and core built as `Head.run` builds them."""
    head = Head(cfg, None, 2, clock=clock)
    head.attach(head.schedule(), [SimpleNamespace(name="task")], WeightPaths(tmp_path, tmp_path, tmp_path),
                SelectionSpec.from_config(cfg.selection),
                RolloutService(cfg, None, tmp_path, IDENTITY, tmp_path / "shards"))
    head.ledger.open()
    head._spawn = lambda coro, name=None: coro.close()  # executions are played by the test
    if engine_urls:
        for c in head.cells:
            c.engine_url = f"http://engine{c.id}"
    return head


def execution_done(head: Head, eid: str, rec, now: float) -> None:
    """An execution the test played, ended at `now`: settled by the rollout service (written down,
    then durable) and told to the core, as `Head._execution` does with one the service ran."""
    head.rollout.settle(rec, lambda r: head.execution_scored(eid, r, now))
    head.execution_recorded(eid, rec, now)


def set_clock(head: Head, clock) -> None:
    """The head and its services read one clock (the test's)."""
    head.clock = head.fleet.clock = head.training.clock = head.ledger.clock = clock
