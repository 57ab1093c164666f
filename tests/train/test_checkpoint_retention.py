"""Bounded disk: over 20 steps of real engine exports and trainer checkpoints, what stays is what an
engine, a resume or a retention rule needs, and the run's bytes stop growing."""

from __future__ import annotations

import pytest

from gyre.config import GyreConfig, TrainConfig
from gyre.position import Position
from gyre.services.retention import Retention, dir_bytes, positions
from gyre.train.export import export_pieces
from gyre.train.toy import random_qwen2

STEPS = 20


@pytest.fixture(scope="module")
def trainer():
    from gyre.train.trainer import EmbeddedTrainer

    return EmbeddedTrainer(TrainConfig(dtype="float32"), random_qwen2(seed=0, std=0.1))


def write_step(trainer, run, version: int, mid_step: bool) -> None:
    """What the leader cell writes when step ``version`` commits (gyre/cell/agent.py _reduce)."""
    if mid_step:  # train.minibatches_per_step = 2: the checkpoint after the step's first update
        trainer.save_checkpoint(run / "checkpoints" / str(Position(version - 1, 1)))
    export_pieces(trainer.hf_state_dict(), trainer.hf_config, run / "weights" / str(Position(version)), version)
    trainer.save_checkpoint(run / "checkpoints" / str(Position(version)))


def retention(run, **run_keys) -> Retention:
    cfg = GyreConfig()
    for k, v in run_keys.items():
        setattr(cfg.run, k, v)
    return Retention.from_config(cfg, run / "weights", run / "checkpoints")


def test_disk_use_stays_bounded_over_20_steps(trainer, tmp_path):
    run = tmp_path / "run"
    ret = retention(run, checkpoint_every=5, keep_checkpoints=2, keep_best=1, best_metric="val_reward")
    used, exports = [], []
    for v in range(1, STEPS + 1):
        write_step(trainer, run, v, mid_step=True)
        ret.record({"step": v - 1, "version": v, "val_reward": 1.0 if v == 7 else 0.1 * (v % 3)})
        served = v - 1 if v % 2 else v  # steps_per_sync = 2: the engines serve every other version
        ret.after_commit(v, served)
        used.append(dir_bytes(run))
        exports.append(sorted(at.step for at in positions(run / "weights")))
        assert set(exports[-1]) <= {v, served, served - 1}, exports[-1]
        assert Position(v) in positions(run / "checkpoints")  # a resume always has its checkpoint
    # at most 3 exports and 1 + 2 + 1 checkpoints (committed, 2 newest of every 5th, best) whatever
    # the step, where keeping everything would hold 20 exports and 39 checkpoints
    export, ckpt = dir_bytes(run / "weights" / "v20"), dir_bytes(run / "checkpoints" / "v20")
    assert max(used) <= 3 * export + 4 * ckpt + 4096 and used[-1] < 0.2 * STEPS * (export + 2 * ckpt)
    assert sorted(str(at) for at in positions(run / "checkpoints")) == ["v15", "v20", "v7"]
    assert max(len(e) for e in exports) <= 3


def test_defaults_keep_every_checkpoint_and_only_the_needed_exports(trainer, tmp_path):
    run = tmp_path / "run"
    ret = retention(run)
    for v in range(1, 6):
        write_step(trainer, run, v, mid_step=False)
        ret.after_commit(v, v)
    assert sorted(at.step for at in positions(run / "checkpoints")) == [1, 2, 3, 4, 5]  # run.keep_checkpoints = 0
    assert sorted(at.step for at in positions(run / "weights")) == [4, 5]


def test_nothing_past_the_committed_step_is_touched(trainer, tmp_path):
    run = tmp_path / "run"
    ret = retention(run, keep_checkpoints=1)
    for v in (1, 2, 3):
        write_step(trainer, run, v, mid_step=False)
    trainer.save_checkpoint(run / "checkpoints" / "v3u1")  # step 4 being written
    (run / "weights" / "v2.tmp-x").mkdir()  # a temporary: not a position
    ret.after_commit(2, 2)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["v2", "v3", "v3u1"]
    assert sorted(p.name for p in (run / "weights").iterdir()) == ["v1", "v2", "v2.tmp-x", "v3"]


def test_best_by_a_lower_metric(tmp_path):
    ret = retention(tmp_path, keep_checkpoints=1, keep_best=2, best_metric="val_loss", best_metric_mode="min")
    for v, loss in enumerate([0.9, 0.2, 0.5, 0.1, 0.7, None], start=1):
        ret.record({"version": v, "val_loss": loss})
    assert ret.kept_checkpoints(6) == {6, 4, 2}
    ret.record({"version": 7})  # a step without the metric is not ranked
    assert ret.kept_checkpoints(7) == {7, 4, 2}


def test_budget_warns_once_before_it_is_crossed(trainer, tmp_path):
    run = tmp_path / "run"
    write_step(trainer, run, 1, mid_step=False)
    one_step = dir_bytes(run)
    ret = retention(run, disk_budget_gb=2.5 * one_step / 1e9)  # room for two steps, not three
    ret.after_commit(1, 1)
    assert ret.budget_warning(1) is None  # 1 step on disk + the next: 2 of 2.5
    write_step(trainer, run, 2, mid_step=False)
    ret.after_commit(2, 2)
    why = ret.budget_warning(2)
    assert why and "run.disk_budget_gb" in why and dir_bytes(run) < ret.disk_budget_bytes  # not yet crossed
    assert ret.budget_warning(2) is None  # once per crossing
