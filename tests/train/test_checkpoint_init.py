"""model.init_from: a new run starts from a `gyre export` of another run's step, with the optimizer
fresh or carried from that step's checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from gyre.batch import expanded_batch
from gyre.config import ConfigError, GyreConfig, TrainConfig, initial_model, load_config

pytestmark = pytest.mark.slow  # a tiny model trained, exported and restarted in a trainer process

PROMPT, RESPONSE = [11, 12, 13, 14], [40, 41, 42, 43, 44, 45]


def batch(trainer):
    mb = expanded_batch([PROMPT + RESPONSE], [len(PROMPT)], old_logprobs=[[0.0] * len(RESPONSE)],
                        advantages=[1.0], execution_index=[0], temperature=1.0)
    mb.old_logprobs = trainer.logprobs(mb)
    return mb


def step(trainer):
    trainer.forward_backward(batch(trainer))
    trainer.optimizer_step()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Run A after two steps, exported: (the trainer of run A, the export directory)."""
    from gyre.cli import main
    from gyre.model.tiny import ensure_tiny_model
    from gyre.report import config_file
    from gyre.train.backends import make_trainer
    from gyre.train.export import export_pieces

    root = tmp_path_factory.mktemp("init")
    model_dir = ensure_tiny_model(root / "model")
    run = root / "run"
    run.mkdir()
    cfg = GyreConfig()
    cfg.run.dir, cfg.model.path = str(run), str(model_dir)
    config_file.write(cfg, run)
    trainer = make_trainer(TrainConfig(dtype="float32", lr=1e-2), model_dir)
    step(trainer)
    step(trainer)
    export_pieces(trainer.hf_state_dict(), trainer.hf_config, run / "weights" / "v2", 2)
    trainer.save_checkpoint(run / "checkpoints" / "v2")
    (run / "state.json").write_text(json.dumps({"version": 2}))
    assert main(["export", str(run), str(root / "out")]) == 0
    return trainer, root / "out"


def test_the_export_is_the_new_runs_model():
    cfg = load_config(None, ["model.path=/base", "model.init_from=/exported"])
    assert initial_model(cfg) == "/exported"
    assert initial_model(load_config(None, ["model.path=/base"])) == "/base"


def test_carried_needs_init_from():
    with pytest.raises(ConfigError, match="model.init_from"):
        load_config(None, ["model.init_optimizer=carried"])
    with pytest.raises(ConfigError, match="model.init_optimizer"):
        load_config(None, ["model.init_optimizer=kept"])


def test_fresh_and_carried_optimizer(exported):
    from gyre.train.backends import make_trainer
    from gyre.train.export import carried_checkpoint

    a, out = exported
    fresh = make_trainer(TrainConfig(dtype="float32", lr=1e-2), out)
    carried = make_trainer(TrainConfig(dtype="float32", lr=1e-2), out)
    carried.load_checkpoint(carried_checkpoint(out), as_start=True)
    assert fresh.step == carried.step == 0  # a new run: its own step count
    mb = batch(a)
    assert torch.allclose(fresh.logprobs(mb), a.logprobs(mb), atol=1e-5)  # the trained weights
    assert not fresh.optimizer.state and carried.optimizer.state  # Adam moments: none vs run A's
    for t in (a, fresh, carried):
        step(t)
    after = {n: t.hf_state_dict()["lm_head.weight"] for n, t in (("a", a), ("fresh", fresh), ("carried", carried))}
    assert torch.equal(after["carried"], after["a"])  # carried: exactly run A's next step
    assert not torch.allclose(after["fresh"], after["a"], atol=1e-7)  # fresh Adam moves differently


def test_a_trainer_process_starts_with_the_carried_state(exported):
    from gyre.cell.trainer_process import TrainerProcess
    from gyre.train.export import carried_checkpoint

    _, out = exported
    proc = TrainerProcess(TrainConfig(dtype="float32"), out, init_state=carried_checkpoint(out))
    try:
        proc.wait_ready(120)
        assert proc.step == 0 and proc.update == 0
    finally:
        proc.close()


def test_an_export_without_its_checkpoint_cannot_carry(tmp_path):
    from gyre.train.export import carried_checkpoint

    with pytest.raises(FileNotFoundError, match="init_optimizer"):
        carried_checkpoint(tmp_path)
    (tmp_path / "gyre_export.json").write_text(json.dumps({"checkpoint": str(tmp_path / "gone")}))
    with pytest.raises(FileNotFoundError, match="is gone"):
        carried_checkpoint(tmp_path)
