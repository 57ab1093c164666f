"""KL to a frozen reference and the entropy bonus: values by hand, gradient direction, both
backends (KL 0 while the policy is the reference; nothing built when off)."""

import math

import pytest
import torch

from gyre.config import ConfigError, load_config
from gyre.train.logprobs import target_logprobs
from gyre.train.loss import Regularizers, kl_estimate, policy_loss_from_logprobs
from tests.train.test_train_loss import _mb
from tests.train.test_train_trainer import make, toy_batch

BACKENDS = ["embedded", "megatron"]


def test_estimators_by_hand():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.8])  # d = +0.5, -0.2
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx([0.5, -0.2])
    assert kl_estimate(logp, ref, "k2").tolist() == pytest.approx([0.125, 0.02])
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx([math.exp(-0.5) - 0.5, math.exp(0.2) - 1.2])


def test_kl_term_in_the_loss_by_hand():
    # zero advantages: the policy term is 0, the loss is kl_coef * sum_t w_t * k3_t
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    mb = _mb([-1.0, -2.0], [0.0, 0.0], [0.25, 0.75])
    ref = torch.tensor([-1.5, -1.8])
    loss, stats = policy_loss_from_logprobs(logp, mb, reg=Regularizers(kl_coef=0.1, kl_estimator="k3"),
                                            ref_logprobs=ref)
    k3 = [math.exp(-0.5) - 0.5, math.exp(0.2) - 1.2]
    assert loss.item() == pytest.approx(0.1 * (0.25 * k3[0] + 0.75 * k3[1]), abs=1e-7)
    assert stats["kl_ref"] == pytest.approx(sum(k3) / 2, abs=1e-7)
    loss.backward()
    # d k3 / d logp = 1 - exp(-d): pushes logp down where it is above the reference, up where below
    assert logp.grad.tolist() == pytest.approx([0.1 * 0.25 * (1 - math.exp(-0.5)), 0.1 * 0.75 * (1 - math.exp(0.2))])
    assert logp.grad[0] > 0 > logp.grad[1]


def test_entropy_bonus_gradient_raises_entropy():
    logits = torch.tensor([[3.0, 0.0, -1.0]], requires_grad=True)  # one target's logits (identity head)
    ent: list = []
    logp = target_logprobs(logits, lambda r: r, torch.tensor([0]), entropy=ent, token_entropy=True)
    mb = _mb([0.0], [0.0], [1.0])
    h = torch.cat(ent)
    loss, stats = policy_loss_from_logprobs(logp, mb, reg=Regularizers(entropy_coef=0.5), token_entropy=h)
    p = torch.softmax(logits.detach(), -1)[0]
    want_h = float(-(p * p.log()).sum())
    assert stats["entropy"] == pytest.approx(want_h, abs=1e-6)
    assert loss.item() == pytest.approx(-0.5 * want_h, abs=1e-6)
    loss.backward()
    with torch.no_grad():  # a gradient-descent step on the loss raises the entropy
        q = torch.softmax(logits - 0.1 * logits.grad, -1)[0]
    assert float(-(q * q.log()).sum()) > want_h


def test_chunked_token_entropy_equals_the_full_computation():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(7, 5, generator=g, requires_grad=True)
    w = torch.randn(11, 5, generator=g)
    targets = torch.randint(0, 11, (7,), generator=g)
    ent: list = []
    logp = target_logprobs(rows, lambda r: r @ w.T, targets, temperature=0.7, chunk=3, entropy=ent, token_entropy=True)
    h = torch.cat(ent)
    full = torch.log_softmax(rows @ w.T / 0.7, -1)
    want = -(full.exp() * full).sum(-1)
    torch.testing.assert_close(h, want)
    torch.testing.assert_close(logp, full.gather(1, targets[:, None])[:, 0])
    (g1,) = torch.autograd.grad(h.sum(), rows)
    (g2,) = torch.autograd.grad(want.sum(), rows)
    torch.testing.assert_close(g1, g2)


def test_off_by_default_and_checked():
    cfg = load_config(None, [])
    assert cfg.train.kl_coef == 0 and cfg.train.entropy_coef == 0 and cfg.train.lr_schedule == "constant"
    with pytest.raises(ConfigError, match="kl_estimator"):
        load_config(None, ["train.kl_estimator=k4"])
    with pytest.raises(ConfigError, match="entropy_coef"):
        load_config(None, ["train.entropy_coef=0.1", "train.tensor_parallel=2"])


def test_off_builds_no_reference():
    trainer = make("embedded")
    assert trainer.reference is None
    trainer.forward_backward(toy_batch(trainer))
    out = trainer.optimizer_step()
    assert "kl_ref" not in out and "ref_memory_bytes" not in out
    with pytest.raises(RuntimeError, match="kl_coef"):
        trainer.reference_logprobs(toy_batch())


@pytest.mark.parametrize("backend", BACKENDS)
def test_kl_is_zero_at_step_0_then_grows_and_costs_a_copy(backend):
    trainer = make(backend, kl_coef=0.05, entropy_coef=0.01, lr=3e-3)
    assert trainer.reference is not None
    n_params = sum(p.numel() for p in trainer.model.parameters())
    assert trainer.reference.nbytes == n_params * 4  # float32 here: one more copy of the weights
    mb = toy_batch(trainer)
    trainer.forward_backward(mb)
    first = trainer.optimizer_step()
    assert first["kl_ref"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before any update
    assert first["ref_memory_bytes"] == trainer.reference.nbytes and first["ref_time_s"] > 0
    assert first["entropy"] > 0
    for _ in range(3):
        trainer.forward_backward(mb)
        out = trainer.optimizer_step()
    assert out["kl_ref"] > 1e-5  # k3 >= 0: the policy moved away from the frozen reference
    # the reference did not move: its log-probs are the initial policy's
    torch.testing.assert_close(trainer.reference_logprobs(mb.to(trainer.device)).cpu(),
                               make(backend).logprobs(mb), rtol=0, atol=1e-5)


def test_offload_moves_the_reference_with_the_policy():
    trainer = make("embedded", kl_coef=0.1)
    plain = make("embedded")
    mb = toy_batch(trainer)
    before = trainer.reference_logprobs(mb)
    moved = trainer.offload()["bytes"] - plain.offload()["bytes"]
    assert moved == trainer.reference.nbytes  # a role switch frees the reference's memory too
    trainer.restore()
    torch.testing.assert_close(trainer.reference_logprobs(mb), before, rtol=0, atol=0)
