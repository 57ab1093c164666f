"""Policy loss, per-execution weighting and advantage estimators on hand-checkable cases."""

import math

import pytest
import torch

from gyre.advantage import advantages
from gyre.batch import MicroBatch, per_execution_weights
from gyre.train.loss import policy_loss, staleness_factor, token_logprobs


def _mb(old, adv, weights, staleness=None, temperature=1.0):
    """One row of T positions over a 2-token vocabulary; position t predicts token 0."""
    T = len(old)
    return MicroBatch(
        input_ids=torch.zeros(1, T, dtype=torch.long),
        position_ids=torch.arange(T)[None],
        attention_mask=torch.zeros(1, 1, T, T, dtype=torch.bool),
        pred_pos=torch.arange(T),
        target_ids=torch.zeros(T, dtype=torch.long),
        old_logprobs=torch.tensor(old),
        advantages=torch.tensor(adv),
        weights=torch.tensor(weights),
        staleness=torch.tensor(staleness or [0] * T),
        execution_index=torch.zeros(T, dtype=torch.long),
        temperature=temperature,
    )


def _logits_for(p):
    """Logits [1, T, 2] whose softmax gives probability p[t] to token 0."""
    p = torch.tensor(p, dtype=torch.float64)
    return torch.stack([torch.log(p), torch.log1p(-p)], -1)[None].float().requires_grad_(True)


def test_logprob_uses_temperature_and_branching_targets():
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]]])
    mb = _mb([0.0] * 3, [0.0] * 3, [1.0] * 3, temperature=2.0)
    mb.pred_pos = torch.tensor([0, 0, 1])  # position 0 predicts two targets (a branch point)
    mb.target_ids = torch.tensor([0, 2, 1])
    got = token_logprobs(logits, mb)
    ref = torch.log_softmax(logits[0] / 2.0, -1)
    assert torch.allclose(got, torch.stack([ref[0, 0], ref[0, 2], ref[1, 1]]))


def test_unclipped_loss_and_gradient_by_hand():
    # p = 0.5, old = log 0.25 -> ratio 2; A = 1, w = 0.5: loss = -0.5 * 2 = -1
    logits = _logits_for([0.5])
    mb = _mb([math.log(0.25)], [1.0], [0.5])
    loss, stats = policy_loss(logits, mb, clip=False)
    assert loss.item() == pytest.approx(-1.0, abs=1e-6)
    assert stats["ratio_mean"] == pytest.approx(2.0, abs=1e-6)
    loss.backward()
    # d/dz0 of -w*A*exp(logp - old) = -w*A*ratio*(1 - p) = -0.5*2*0.5; z1 gets the opposite
    assert torch.allclose(logits.grad[0, 0], torch.tensor([-0.5, 0.5]), atol=1e-6)


def test_ppo_clipping_by_hand():
    # token 0: ratio 2, A=+1 -> clipped at 1.28, no gradient
    # token 1: ratio 2, A=-1 -> min(-2, -1.28) = -2 unclipped (pessimistic), gradient flows
    # token 2: ratio 0.5, A=+1 -> min(0.5, 0.8) = 0.5 unclipped
    logits = _logits_for([0.5, 0.5, 0.5])
    mb = _mb([math.log(0.25), math.log(0.25), math.log(1.0)], [1.0, -1.0, 1.0], [1.0] * 3)
    loss, stats = policy_loss(logits, mb, clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx(-(1.28) + 2.0 - 0.5, abs=1e-5)
    assert stats["clip_frac"] == pytest.approx(1 / 3)
    loss.backward()
    assert torch.all(logits.grad[0, 0] == 0)
    assert torch.all(logits.grad[0, 1] != 0) and torch.all(logits.grad[0, 2] != 0)


def test_staleness_weights_scale_and_mask():
    s = torch.tensor([0, 1, 2, 5])
    assert staleness_factor(s, [1.0, 0.5]).tolist() == [1.0, 0.5, 0.0, 0.0]
    assert staleness_factor(s, []).tolist() == [1.0] * 4
    assert staleness_factor(s, ["1", "0.5"]).tolist() == [1.0, 0.5, 0.0, 0.0]  # from an override
    logits = _logits_for([0.5, 0.5, 0.5])
    mb = _mb([math.log(0.5)] * 3, [1.0] * 3, [1.0] * 3, staleness=[0, 1, 3])
    loss, _ = policy_loss(logits, mb, clip=False, staleness_weights=[1.0, 0.5])
    assert loss.item() == pytest.approx(-1.5, abs=1e-6)


def test_per_execution_weighting_long_does_not_outweigh_short():
    # execution 0: 100 target tokens, execution 1: 2 target tokens, opposite advantages
    exe = torch.tensor([0] * 100 + [1] * 2)
    w = per_execution_weights(exe)
    assert w[exe == 0].sum().item() == pytest.approx(0.5)
    assert w[exe == 1].sum().item() == pytest.approx(0.5)
    # on-policy, same probability everywhere: the two executions cancel exactly
    T = len(exe)
    logits = _logits_for([0.5] * T)
    mb = _mb([math.log(0.5)] * T, [1.0] * 100 + [-1.0] * 2, w.float().tolist())
    loss, _ = policy_loss(logits, mb, clip=False)
    assert loss.item() == pytest.approx(0.0, abs=1e-6)
    loss.backward()
    g = logits.grad[0, :, 0]
    assert g[:100].sum().item() == pytest.approx(-g[100:].sum().item(), rel=1e-5)


def test_micro_batches_sum_to_the_step_loss():
    T = 6
    logits = _logits_for([0.2, 0.4, 0.5, 0.6, 0.7, 0.9])
    old = [math.log(0.3)] * T
    adv = [1.0, -1.0, 0.5, 2.0, -0.5, 1.0]
    w = [0.1, 0.2, 0.1, 0.3, 0.2, 0.1]
    whole, _ = policy_loss(logits, _mb(old, adv, w))
    parts = 0.0
    for sl in (slice(0, 2), slice(2, 6)):
        part = _mb(old[sl], adv[sl], w[sl])
        parts = parts + policy_loss(logits[:, sl], part)[0]
    assert whole.item() == pytest.approx(parts.item(), abs=1e-6)


def test_advantage_estimators():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 5.0])
    g = torch.tensor([0, 0, 0, 0, 1, 2])
    grpo = advantages(r, g, "grpo")
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()  # Bessel-corrected
    assert torch.allclose(grpo[:4], (r[:4] - 0.5) / (std + 1e-6))
    assert grpo[4:].tolist() == [0.0, 0.0]  # a group of one has no relative signal
    rloo = advantages(r, g, "rloo")
    assert torch.allclose(rloo[:4], torch.tensor([1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3]))
    assert rloo[4:].tolist() == [0.0, 0.0]
    assert advantages(r, g, "reward").tolist() == r.tolist()
    assert advantages(torch.ones(3), torch.zeros(3, dtype=torch.long), "grpo").tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="unknown advantage"):
        advantages(r, g, "ppo")
