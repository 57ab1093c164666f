"""Both trainer backends behind one interface: learning, offload, checkpoints, export, agreement."""

import copy
import json

import pytest
import torch

from gyre.config import TrainConfig
from gyre.batch import expanded_batch, select_rows
from gyre.train.toy import random_qwen2

BACKENDS = ["embedded", "megatron"]


def make(backend, *, seed=0, **overrides):
    cfg = TrainConfig(backend=backend, **{"lr": 1e-4, "dtype": "float32", **overrides})
    hf = random_qwen2(seed=seed, std=0.1)
    if backend == "megatron":
        from gyre.train.megatron_trainer import MegatronTrainer

        return MegatronTrainer(cfg, hf.config, hf.state_dict(), seed=seed)
    from gyre.train.trainer import EmbeddedTrainer

    return EmbeddedTrainer(cfg, hf)


def toy_batch(trainer=None):
    """Two rewarded and two penalised responses to shared prompts, in two groups."""
    g = torch.Generator().manual_seed(7)
    prompts = [[1, 2, 3, 4], [1, 2, 3, 4], [9, 8, 7], [9, 8, 7]]
    seqs = [p + torch.randint(10, 90, (n,), generator=g).tolist() for p, n in zip(prompts, [6, 5, 7, 4])]
    plens = [len(p) for p in prompts]
    zeros = [[0.0] * (len(s) - n) for s, n in zip(seqs, plens)]
    mb = expanded_batch(seqs, plens, old_logprobs=zeros, advantages=[1.0, -1.0, 1.0, -1.0],
                        execution_index=[0, 1, 2, 3], temperature=0.9)
    if trainer is not None:  # on-policy: behaviour log-probs are the current policy's
        mb.old_logprobs = trainer.logprobs(mb)
    return mb


def params(trainer):
    return {k: v.clone() for k, v in trainer.hf_state_dict().items()}


def assert_same(a, b, path=""):
    """Recursive bit-equality of nested dicts/lists/tensors."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


@pytest.mark.parametrize("backend", BACKENDS)
def test_steps_on_toy_batch_raise_rewarded_logprobs(backend):
    trainer = make(backend)
    mb = toy_batch(trainer)
    before = trainer.logprobs(mb)
    losses = []
    for _ in range(6):
        trainer.forward_backward(mb)
        out = trainer.optimizer_step()
        losses.append(out["loss"])
        assert out["grad_norm"] > 0 and out["targets"] == mb.num_targets
    delta = trainer.logprobs(mb) - before
    pos = mb.advantages > 0
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert delta[pos].mean() > 0.2 and delta[~pos].mean() < -0.2
    assert trainer.step == 6


def test_backends_agree():
    # adam_eps=1: the first update is ~ lr * grad, not lr * sign(grad), so rounding stays rounding
    emb, meg = make("embedded", adam_eps=1.0, lr=1e-2), make("megatron", adam_eps=1.0, lr=1e-2)
    mb = toy_batch(emb)
    assert torch.allclose(emb.logprobs(mb), meg.logprobs(mb), atol=1e-5)
    stats = []
    for t in (emb, meg):
        for half in (slice(0, 2), slice(2, 4)):  # the same step split into micro-batches
            t.forward_backward(select_rows(mb, list(range(4))[half]))
        stats.append(t.optimizer_step())
    assert stats[0]["loss"] == pytest.approx(stats[1]["loss"], abs=1e-5)
    assert stats[0]["grad_norm"] == pytest.approx(stats[1]["grad_norm"], rel=1e-4)
    a, b = params(emb), params(meg)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-7), k
        assert not torch.equal(a[k], random_qwen2(seed=0, std=0.1).state_dict()[k]) or "k_proj.bias" in k


@pytest.mark.parametrize("backend", BACKENDS)
def test_offload_restore_is_bit_identical(backend):
    trainer, twin = make(backend), make(backend)
    mb = toy_batch(trainer)
    trainer.forward_backward(mb)
    with pytest.raises(RuntimeError, match="between steps"):
        trainer.offload()
    trainer.optimizer_step()
    twin.forward_backward(mb)
    twin.optimizer_step()
    state = copy.deepcopy(trainer._state())
    off = trainer.offload()
    assert off["bytes"] > 0 and off["total_s"] >= 0
    model = trainer.model
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    with pytest.raises(RuntimeError, match="already offloaded"):
        trainer.offload()
    back = trainer.restore()
    assert back["bytes"] == off["bytes"]
    assert_same(state, trainer._state())
    for t in (trainer, twin):  # training continues exactly as if nothing happened
        t.forward_backward(mb)
        t.optimizer_step()
    assert_same(params(trainer), params(twin))


@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoint_resumes_identically(backend, tmp_path):
    a = make(backend)
    mb = toy_batch(a)
    a.forward_backward(mb)
    a.optimizer_step()
    ckpt = a.save_checkpoint(tmp_path / "ckpt")
    a.forward_backward(mb)
    after_a = a.optimizer_step()

    b = make(backend, seed=5)  # different weights: everything must come from the checkpoint
    b.load_checkpoint(ckpt)
    assert b.step == 1
    b.forward_backward(mb)
    after_b = b.optimizer_step()
    assert_same(params(a), params(b))
    assert after_a["loss"] == after_b["loss"] and after_a["grad_norm"] == after_b["grad_norm"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary left behind


@pytest.mark.parametrize("backend", BACKENDS)
def test_export_loads_in_transformers_with_same_logprobs(backend, tmp_path):
    from transformers import AutoModelForCausalLM

    from gyre.train.trainer import EmbeddedTrainer

    trainer = make(backend)
    mb = toy_batch(trainer)
    trainer.forward_backward(mb)
    trainer.optimizer_step()  # export trained weights, not the initial ones
    out = trainer.export_weights(tmp_path / "weights", weight_version=3)
    assert json.loads((out / "gyre_weights.json").read_text()) == {"weight_version": "3"}
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "gyre_weights.json", "weights.sha256.json"}
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    engine_side = EmbeddedTrainer(TrainConfig(), hf).logprobs(mb)
    assert torch.allclose(engine_side, trainer.logprobs(mb), atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_make_trainer_from_engine_model_dir(backend, tmp_path):
    from gyre.train.backends import make_trainer

    random_qwen2(seed=0, std=0.1).save_pretrained(tmp_path / "m")  # config.json + model.safetensors
    trainer = make_trainer(TrainConfig(backend=backend, dtype="float32"), tmp_path / "m")
    assert type(trainer).__name__ == {"embedded": "EmbeddedTrainer", "megatron": "MegatronTrainer"}[backend]
    mb = toy_batch()
    assert torch.allclose(trainer.logprobs(mb), make("embedded").logprobs(mb), atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_logprobs_and_recompute_equal_the_full_computation(backend):
    """train.logprob_chunk (targets projected a few at a time, only at pred_pos) and
    train.recompute (per-layer activation checkpointing; Megatron's full recompute) change
    memory, not the log-probs or the gradients: checked against the [B, S, V] logits."""
    from gyre.train.loss import policy_loss, token_logprobs

    lean, full = make(backend, logprob_chunk=3, recompute=True), make(backend)
    mb = toy_batch(full)
    # off-policy, by a different amount per token: the ratios differ from 1 and from each other, so
    # the loss is not zero (a uniform shift scales a zero-mean advantage sum: a loss of rounding
    # noise, whose sign differs between CPUs)
    mb.old_logprobs = mb.old_logprobs - 0.05 * (1 + torch.arange(mb.old_logprobs.numel()).reshape(mb.old_logprobs.shape) % 5)
    with torch.no_grad():
        want = token_logprobs(full._logits(mb.to(full.device)), mb)
    assert torch.allclose(lean.logprobs(mb), want, atol=1e-5)
    st = lean.forward_backward(mb)
    z = full._logits(mb.to(full.device))  # the reference: every position's logits, then the loss
    loss, _ = policy_loss(z, mb, off_policy=full.off_policy, prox_logprobs=full.logprobs(mb))
    loss.backward()
    ref = full.flat_grads()
    # float32: log-probs agree to ~1e-6 (asserted to 1e-5 above), the summed loss to ~1e-5 relative
    assert abs(float(loss)) > 1e-3 and st["loss"] == pytest.approx(float(loss), rel=1e-4)
    assert float(ref.abs().max()) > 1e-4 and torch.allclose(lean.flat_grads(), ref, atol=1e-6)
