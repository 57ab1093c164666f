"""Off-policy corrections (train.off_policy): each term of the loss against the right policy.

Every token below is built so that taking the importance weight, its truncation, the mask or the
clip from the wrong one of the three policies (behaviour, prox = the trainer at the step start,
current) changes the gradient; `reference` is an independent autograd version of the loss with
the policy of each term as a parameter, and each test checks both that the implementation equals
the right variant and that every wrong variant differs on this case.
"""

import math

import pytest
import torch

from gyre.batch import MicroBatch, expanded_batch
from gyre.config import ConfigError, GyreConfig, TrainConfig, load_config, resolved_off_policy, trainer_config
from gyre.train.loss import OffPolicy, policy_loss, token_logprobs
from gyre.train.step_stats import hist_quantile, merge, summarize

# (p current, q prox, b behaviour, advantage) per token; clip 0.2/0.28, tis cap C = 2
TOKENS = [
    (0.50, 0.45, 0.30, +1.0),  # weight q/b = 1.5 but p/b = 1.67; p/q inside the clip, p/b outside
    (0.25, 0.22, 0.05, +1.0),  # q/b = 4.4: truncated to C = 2 by tis, not by decoupled
    (0.50, 0.30, 0.45, +1.0),  # p/q = 1.67 clipped (no gradient); p/b = 1.11 would not be
    (0.30, 0.40, 0.30, -1.0),  # p/q = 0.75 < 0.8 with A < 0: clipped; p/b = 1 would not be
]
MASK_TOKENS = [
    (0.30, 0.50, 0.20, +1.0),  # q/b = 2.5 outside [0.5, 2]: masked; p/b = 1.5 inside
    (0.90, 0.75, 0.40, +1.0),  # q/b = 1.875 inside: kept; p/b = 2.25 outside
]


def _batch(tokens, staleness=None):
    T = len(tokens)
    return MicroBatch(
        input_ids=torch.zeros(1, T, dtype=torch.long), position_ids=torch.arange(T)[None],
        attention_mask=torch.zeros(1, 1, T, T, dtype=torch.bool), pred_pos=torch.arange(T),
        target_ids=torch.zeros(T, dtype=torch.long),
        old_logprobs=torch.tensor([math.log(t[2]) for t in tokens]),
        advantages=torch.tensor([t[3] for t in tokens]), weights=torch.ones(T),
        staleness=torch.tensor(staleness or [0] * T), execution_index=torch.zeros(T, dtype=torch.long))


def _logits(tokens):
    p = torch.tensor([t[0] for t in tokens], dtype=torch.float64)
    return torch.stack([torch.log(p), torch.log1p(-p)], -1)[None].float().requires_grad_(True)


def _prox(tokens):
    return torch.tensor([math.log(t[1]) for t in tokens])


def implementation_grad(tokens, off: OffPolicy):
    z = _logits(tokens)
    loss, stats = policy_loss(z, _batch(tokens), 0.2, 0.28, off_policy=off,
                              prox_logprobs=_prox(tokens) if off.needs_prox else None)
    loss.backward()
    return z.grad, stats


def reference(tokens, *, weight_of=None, cap=None, mask_of=None, clip_of="prox", mask=(0.5, 2.0)):
    """-sum c_t min(r_t A, clip(r_t) A): c from `weight_of` (truncated at `cap`, masked by
    `mask_of`), r against `clip_of`; each of them one of prox / behaviour / current."""
    z = _logits(tokens)
    logp = torch.log_softmax(z[0], -1)[:, 0]
    lb = torch.tensor([math.log(t[2]) for t in tokens])
    pol = {"prox": _prox(tokens), "behaviour": lb, "current": logp.detach()}
    adv = torch.tensor([t[3] for t in tokens])
    c = torch.exp(pol[weight_of] - lb) if weight_of else torch.ones_like(lb)
    if cap is not None:
        c = c.clamp(max=cap)
    if mask_of is not None:
        r = torch.exp(pol[mask_of] - lb)
        c = torch.where((r < mask[0]) | (r > mask[1]), torch.zeros_like(c), c)
    r = torch.exp(logp - pol[clip_of])
    loss = -(c * torch.minimum(r * adv, r.clamp(0.8, 1.28) * adv)).sum()
    loss.backward()
    return z.grad


def _check(got, right: dict, wrong: dict[str, dict], tokens):
    want = reference(tokens, **right)
    assert torch.allclose(got, want, atol=1e-6), (got, want)
    for name, variant in wrong.items():
        assert not torch.allclose(reference(tokens, **variant), want, atol=1e-4), f"case does not tell {name}"


def test_off_policy_tis_weight_truncation_and_clip_use_pi_old():
    got, stats = implementation_grad(TOKENS, OffPolicy("tis", is_cap=2.0))
    right = dict(weight_of="prox", cap=2.0, clip_of="prox")
    _check(got, right, {
        "weight from the current policy": {**right, "weight_of": "current"},
        "weight not truncated": {**right, "cap": None},
        "no weight": {**right, "weight_of": None},
        "clip against the behaviour policy": {**right, "clip_of": "behaviour"},
        "ratio and clip against the current policy": {**right, "clip_of": "current"},
    }, TOKENS)
    assert stats["truncated_n"] == 1 and stats["masked_n"] == 0
    assert torch.all(got[0, 2] == 0) and torch.all(got[0, 3] == 0)  # clipped against pi_old


def test_off_policy_decoupled_weight_untruncated_clip_against_prox():
    got, stats = implementation_grad(TOKENS, OffPolicy("decoupled"))
    right = dict(weight_of="prox", clip_of="prox")
    _check(got, right, {
        "weight from the current policy": {**right, "weight_of": "current"},
        "weight truncated (that is tis)": {**right, "cap": 2.0},
        "clip against the behaviour policy (plain PPO)": {**right, "clip_of": "behaviour"},
    }, TOKENS)
    assert stats["truncated_n"] == 0
    assert stats["is_weight_mean"] == pytest.approx((1.5 + 4.4 + 2 / 3 + 4 / 3) / 4, rel=1e-5)


@pytest.mark.parametrize("mode", ["tis", "decoupled"])
def test_off_policy_mask_uses_pi_old_over_behaviour(mode):
    got, stats = implementation_grad(MASK_TOKENS, OffPolicy(mode, mask=True, mask_low=0.5, mask_high=2.0))
    right = dict(weight_of="prox", cap=2.0 if mode == "tis" else None, mask_of="prox")
    _check(got, right, {
        "mask by the current policy": {**right, "mask_of": "current"},
        "no mask": {**right, "mask_of": None},
    }, MASK_TOKENS)
    assert torch.all(got[0, 0] == 0) and torch.all(got[0, 1] != 0)
    assert stats["masked_n"] == 1


def test_off_policy_none_is_ppo_against_behaviour():
    got, _ = implementation_grad(TOKENS, OffPolicy("none"))
    _check(got, dict(clip_of="behaviour"), {"clip against prox": dict(clip_of="prox")}, TOKENS)


def test_off_policy_prox_defaults_to_the_current_weights_and_valid_constants():
    z, mb = _logits(TOKENS), _batch(TOKENS)
    loss, st = policy_loss(z, mb, off_policy=OffPolicy("tis"))  # no update yet: pi_prox = pi_theta
    want, _ = policy_loss(z, mb, off_policy=OffPolicy("tis"), prox_logprobs=token_logprobs(z, mb).detach())
    assert float(loss) == pytest.approx(float(want)) and st["prox_drift_max"] == 0.0
    with pytest.raises(ValueError, match="choose one of"):
        OffPolicy("clip")
    with pytest.raises(ValueError, match="is_mask_low"):
        OffPolicy("tis", mask=True, mask_low=2.0, mask_high=1.0)


def test_off_policy_config_auto_and_validation(tmp_path):
    cfg = GyreConfig()
    assert cfg.train.off_policy == "auto" and resolved_off_policy(cfg) == "tis"
    # decoupled only where its clip against pi_prox can act: lagged groups and several updates a step
    assert resolved_off_policy(load_config(None, ["sched.staleness=2"])) == "tis"
    assert resolved_off_policy(load_config(None, ["sched.staleness=2", "train.minibatches_per_step=4"])) == "decoupled"
    assert resolved_off_policy(load_config(None, ["sched.steps_per_sync=4", "train.minibatches_per_step=2"])) == "decoupled"
    assert resolved_off_policy(load_config(None, ["sched.staleness=2", "train.off_policy=none"])) == "none"
    with pytest.raises(ConfigError, match="train.off_policy: 'ppo' is not allowed; choose one of auto"):
        load_config(None, ["train.off_policy=ppo"])
    with pytest.raises(ConfigError, match="is_mask_low"):
        load_config(None, ["train.is_mask=true", "train.is_mask_low=3"])
    with pytest.raises(ConfigError, match="train.is_cap"):
        load_config(None, ["train.is_cap=0.5"])
    staleness_1 = ["sched.staleness=1", "train.minibatches_per_step=4"]
    assert OffPolicy.from_config(trainer_config(load_config(None, staleness_1))).mode == "decoupled"
    assert OffPolicy.from_config(TrainConfig()).mode == "tis"  # alone: no schedule, nothing lags
    with pytest.raises(ConfigError, match="train.minibatches_per_step"):
        load_config(None, ["train.minibatches_per_step=0"])
    from gyre.sched.runspec import RunSpec  # a live run: one reduce per update, pi_prox asked only where it acts

    def core(*over):
        c = RunSpec.from_config(load_config(None, list(over))).core
        return c.minibatches, c.prox

    assert core("train.minibatches_per_step=2", "train.off_policy=decoupled") == (2, True)
    assert core("train.minibatches_per_step=2", "train.off_policy=none") == (2, False)  # clips against behaviour


def test_off_policy_mismatch_stats_by_lag_merge_exactly():
    # prox = behaviour + d per token; lag 0 vs lag 2 tokens; split into two micro-batches
    tokens = [(0.5, 0.5, 0.5, 1.0), (0.5, 0.4, 0.5, 1.0), (0.5, 0.6, 0.3, 1.0), (0.5, 0.2, 0.4, 1.0)]
    lags = [0, 0, 2, 2]
    parts = []
    for sl in (slice(0, 1), slice(1, 4)):
        z = _logits(tokens[sl])
        _, st = policy_loss(z, _batch(tokens[sl], lags[sl]), off_policy=OffPolicy("tis"),
                            prox_logprobs=_prox(tokens[sl]))
        parts.append(st)
    s = summarize(merge(parts, parallel=False))
    d = [math.log(q / b) for _, q, b, _ in tokens]
    k3 = [math.expm1(x) - x for x in d]
    assert s["mismatch_abs_mean_lag0"] == pytest.approx((abs(d[0]) + abs(d[1])) / 2, rel=1e-5)
    assert s["mismatch_abs_max_lag2"] == pytest.approx(max(abs(d[2]), abs(d[3])), rel=1e-5)
    assert s["mismatch_k3_lag2"] == pytest.approx((k3[2] + k3[3]) / 2, rel=1e-4)
    assert s["mismatch_tokens_lag0"] == 2 and s["truncated_frac"] == 0.0
    # the median ratio is the second smallest, to the histogram's 1% bins
    assert s["ratio_q50"] == pytest.approx(sorted(math.exp(x) for x in d)[1], rel=0.006)
    assert s["ratio_q01"] == pytest.approx(min(math.exp(x) for x in d), rel=0.006)
    assert hist_quantile([0] * 403, 0.5) is None
    assert hist_quantile([0] * 201 + [5] + [0] * 201, 0.5) == 1.0  # the bin centred on ratio 1


def _trainer(backend, **over):
    from gyre.train.toy import random_qwen2

    cfg = TrainConfig(backend=backend, **{"lr": 1e-2, "adam_eps": 1.0, "dtype": "float32", **over})
    hf = random_qwen2(seed=0, std=0.1)
    if backend == "megatron":
        from gyre.train.megatron_trainer import MegatronTrainer

        return MegatronTrainer(cfg, hf.config, hf.state_dict())
    from gyre.train.trainer import EmbeddedTrainer

    return EmbeddedTrainer(cfg, hf)


def _toy(trainer):
    g = torch.Generator().manual_seed(3)
    seqs = [[1, 2, 3] + torch.randint(10, 90, (n,), generator=g).tolist() for n in (6, 5)]
    mb = expanded_batch(seqs, [3, 3], old_logprobs=[[0.0] * 6, [0.0] * 5], advantages=[1.0, -1.0],
                        execution_index=[0, 1], staleness=[0, 1])
    shift = torch.tensor([-0.9, 0.3, -0.2, 0.5, -0.4, 0.1] * 2)[: mb.num_targets]  # q/b from 0.6 to 2.5
    mb.old_logprobs = trainer.logprobs(mb) + shift
    return mb


@pytest.mark.parametrize("backend", ["embedded", "megatron"])
def test_off_policy_trainer_prox_needs_no_extra_forward_before_an_update(backend, monkeypatch):
    trainer, twin = _trainer(backend, off_policy="tis"), _trainer(backend, off_policy="none")
    mb = _toy(trainer)
    calls = []
    real = trainer._target_logprobs
    monkeypatch.setattr(trainer, "_target_logprobs", lambda m, **kw: calls.append(torch.is_grad_enabled()) or real(m, **kw))
    st = trainer.forward_backward(mb)
    assert calls == [True]  # pi_prox = pi_theta before any update: only the forward that trains
    assert st["truncated_n"] == 2 and st["prox_drift_max"] < 1e-5  # the two tokens shifted by -0.9
    # the same step by hand, from full [B, S, V] logits (the trainer projects only the targets, in
    # chunks): prox = the trainer's own log-probs now (not the behaviour's)
    z = twin._logits(mb.to(twin.device))
    loss, _ = policy_loss(z, mb, off_policy=OffPolicy("tis"), prox_logprobs=twin.logprobs(mb))
    loss.backward()
    want = twin.flat_grads()
    assert torch.allclose(trainer.flat_grads(), want, atol=1e-6)
    twin.clear_gradients()
    twin.forward_backward(mb)  # off_policy = none: what taking the behaviour log-probs as pi_old gives
    assert not torch.allclose(twin.flat_grads(), want, atol=1e-4)
    out = trainer.optimizer_step()
    assert out["off_policy"] == "tis" and out["truncated_frac"] == pytest.approx(2 / mb.num_targets)
    assert {"mismatch_k3_lag0", "mismatch_k3_lag1", "ratio_q50"} <= set(out)
    # step 2: pi_prox is the weights after step 1, not a copy kept from step 1
    before = trainer.logprobs(mb)
    st2 = trainer.forward_backward(mb)
    assert st2["prox_drift_max"] < 1e-5
    assert (before - mb.old_logprobs).abs().max() > 1e-3
    assert st2["is_weight_mean"] != pytest.approx(st["is_weight_mean"], abs=1e-4)


@pytest.mark.parametrize("n", [1, 2])
def test_minibatches_update_within_a_step_against_the_step_start(n, monkeypatch):
    trainer = _trainer("embedded", off_policy="decoupled", lr=0.2)
    mbs = [_toy(trainer), _toy(trainer)]
    calls = []
    real = trainer._target_logprobs
    monkeypatch.setattr(trainer, "_target_logprobs",
                        lambda m, **kw: calls.append(torch.is_grad_enabled()) or real(m, **kw))
    out = trainer.train_step(mbs, n)
    assert out["step"] == trainer.step == 1 and out["minibatches"] == n and len(out["minibatch_grad_norms"]) == n
    if n == 1:  # one update: pi_prox is pi_theta, no extra forward, and the clip against it cannot act
        assert calls == [True, True] and out["prox_drift_max"] == 0.0 and out["clip_frac"] == 0.0
    else:  # the second part's pi_prox: one no-grad forward before the first update
        assert calls == [False, True, True]
        assert out["prox_drift_max"] > 1e-3 and out["clip_frac"] > 0.0


def test_off_policy_lag0_mismatch_warns_only_past_the_threshold():
    from gyre.train.step_stats import lag0_warning

    def summary(shift: float, lag: int = 0) -> dict:
        # behaviour log-probs off by `shift` at the same weights: what wrong weights or a wrong
        # template look like to the trainer
        toks = [(0.5, 0.5, 0.5 * math.exp(-shift), 1.0), (0.4, 0.4, 0.4 * math.exp(-shift), -1.0)]
        _, st = policy_loss(_logits(toks), _batch(toks, [lag] * 2), off_policy=OffPolicy("tis"),
                            prox_logprobs=_prox(toks))
        return summarize(merge([st]))

    bad = summary(0.5)  # k3 = e^0.5 - 1 - 0.5 = 0.149
    assert bad["mismatch_k3_lag0"] == pytest.approx(math.expm1(0.5) - 0.5, rel=1e-4)
    msg = lag0_warning(bad, 0.01)
    assert msg and "lag 0" in msg and "train.mismatch_warn_k3" in msg and "template" in msg
    assert lag0_warning(summary(0.05), 0.01) is None  # k3 0.0013: numerics, not a bug
    assert lag0_warning(bad, 0.0) is None             # 0 = never
    assert lag0_warning(summary(0.5, lag=2), 0.01) is None  # lagged tokens differ by design
