"""Learning-rate warmup and decay: the formula, both backends applying it, and resume."""

import math

import pytest
import torch

from gyre.config import ConfigError, TrainConfig, load_config, trainer_config
from gyre.train.lr_schedule import LrSchedule
from tests.train.test_train_trainer import make, toy_batch

BACKENDS = ["embedded", "megatron"]


def test_warmup_then_cosine_by_hand():
    s = LrSchedule(lr=1.0, style="cosine", warmup_steps=2, decay_steps=6, min_lr=0.1)
    # warmup: step 1 trains at lr/2, step 2 at lr; cosine over steps 2..6: ratio (n-2)/4
    want = [0.5, 1.0, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)), 0.55,
            0.1 + 0.9 * 0.5 * (1 + math.cos(3 * math.pi / 4)), 0.1, 0.1]
    assert [s.lr_at(n) for n in range(1, 8)] == pytest.approx(want)


def test_linear_and_constant():
    lin = LrSchedule(lr=2.0, style="linear", warmup_steps=0, decay_steps=4, min_lr=0.0)
    assert [lin.lr_at(n) for n in range(1, 6)] == pytest.approx([1.5, 1.0, 0.5, 0.0, 0.0])
    const = LrSchedule(lr=2.0, style="constant", warmup_steps=4)
    assert [const.lr_at(n) for n in (1, 4, 5, 100)] == pytest.approx([0.5, 2.0, 2.0, 2.0])
    assert LrSchedule(lr=3e-4).lr_at(1) == 3e-4  # the default: constant, no warmup


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_same_formula_as_megatrons_scheduler(style):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class Opt:  # what the scheduler touches of a MegatronOptimizer
        param_groups = [{}]

    s = LrSchedule(lr=1e-3, style=style, warmup_steps=3, decay_steps=10, min_lr=1e-5)
    meg = OptimizerParamScheduler(Opt(), 0.0, s.lr, s.min_lr, s.warmup_steps, s.horizon, style, 0.0, 0.0, 0,
                                  "constant")
    for n in range(1, 13):
        meg.step(1)
        assert Opt.param_groups[0]["lr"] == pytest.approx(s.lr_at(n)), n


def test_config_checks_and_resolves_the_horizon():
    cfg = load_config(None, ["train.lr_schedule=cosine", "train.lr_warmup_steps=1", "run.steps=5"])
    assert trainer_config(cfg).lr_decay_steps == 5
    with pytest.raises(ConfigError, match="lr_warmup_steps"):
        load_config(None, ["train.lr_schedule=cosine", "train.lr_warmup_steps=5", "run.steps=5"])
    with pytest.raises(ConfigError, match="min_lr"):
        load_config(None, ["train.min_lr=1", "train.lr=0.1"])
    with pytest.raises(ConfigError, match="lr_schedule"):
        load_config(None, ["train.lr_schedule=exponential"])


def optimizer_lrs(trainer):
    return [g["lr"] for g in trainer.optimizer.param_groups]


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_applies_the_schedule_and_resumes_it(backend, tmp_path):
    kw = dict(lr=1e-3, lr_schedule="cosine", lr_warmup_steps=2, lr_decay_steps=5, min_lr=1e-4)
    sched = LrSchedule.from_config(TrainConfig(**kw))
    trainer = make(backend, **kw)
    mb = toy_batch(trainer)
    assert optimizer_lrs(trainer) == pytest.approx([sched.lr_at(1)] * len(optimizer_lrs(trainer)))
    logged = []
    for _ in range(2):
        trainer.forward_backward(mb)
        logged.append(trainer.optimizer_step()["lr"])
    assert logged == pytest.approx([sched.lr_at(1), sched.lr_at(2)]) and logged[0] < logged[1]
    assert optimizer_lrs(trainer) == pytest.approx([sched.lr_at(3)] * len(optimizer_lrs(trainer)))
    trainer.save_checkpoint(tmp_path / "ck")

    fresh = make(backend, **kw)  # a restarted trainer: step 0's rate until the checkpoint says otherwise
    assert optimizer_lrs(fresh) == pytest.approx([sched.lr_at(1)] * len(optimizer_lrs(fresh)))
    fresh.load_checkpoint(tmp_path / "ck")
    assert fresh.step == 2 and optimizer_lrs(fresh) == pytest.approx([sched.lr_at(3)] * len(optimizer_lrs(fresh)))
    fresh.forward_backward(mb)
    assert fresh.optimizer_step()["lr"] == pytest.approx(sched.lr_at(3))
    trainer.forward_backward(mb)
    trainer.optimizer_step()
    # the resumed trainer took the same third update as the one that never stopped
    for k, v in trainer.hf_state_dict().items():
        torch.testing.assert_close(fresh.hf_state_dict()[k], v, rtol=0, atol=1e-6)


def test_step_rows_log_the_rate_kl_and_reference_cost():
    """The head's step row (gyre.services.training.step_figures) says what the trainers applied."""
    from gyre.services.training import TrainingDispatch

    cfg = load_config(None, ["train.lr=0.01", "train.lr_schedule=linear", "train.lr_warmup_steps=1", "run.steps=3",
                             "train.kl_coef=0.1"])
    d = TrainingDispatch(cfg, [], emit=lambda ev: None, clock=lambda: 0.0, spawn=lambda c: None)
    mb = [{"loss": 0.0, "targets": 10, "tokens": 20, "fwd_bwd_s": 2.0, "kl_ref": 0.5, "ref_time_sum": 0.5,
           "ref_bytes_max": 1024},
          {"loss": 0.0, "targets": 30, "tokens": 40, "fwd_bwd_s": 2.0, "kl_ref": 0.1, "ref_time_sum": 0.5,
           "ref_bytes_max": 1024}]
    rates = [d.step_figures(mb, 0, 1, (), step=i)[0]["learning_rate"] for i in range(3)]
    assert rates == pytest.approx([0.01, 0.005, 0.0])  # warmup step, then linear to min_lr at run.steps
    extra = d.step_figures(mb, 0, 1, (), step=0)[0]
    assert extra["kl_ref_mean"] == pytest.approx((0.5 * 10 + 0.1 * 30) / 40)  # per target
    assert extra["ref_time_fraction"] == pytest.approx(0.25) and extra["ref_memory_bytes"] == 1024
    assert "kl_ref_mean" not in d.step_figures([{"loss": 0.0, "targets": 1, "tokens": 1}], 0, 1, ())[0]
