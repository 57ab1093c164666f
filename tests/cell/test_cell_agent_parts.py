"""The pieces a cell agent is built from: flat gradients, the wire format, the trainer process."""

import os
import signal

import numpy as np
import pytest
import torch

from gyre.batch import MicroBatch, expanded_batch, from_wire, to_wire
from gyre.config import TrainConfig
from gyre.train.toy import random_qwen2


def _batch(rows=(0, 1)):
    seqs = [[1, 2, 3, 40, 41, 42], [9, 8, 70, 71]]
    plens = [3, 2]
    pick = list(rows)
    return expanded_batch([seqs[r] for r in pick], [plens[r] for r in pick],
                          old_logprobs=[[-4.0] * (len(seqs[r]) - plens[r]) for r in pick],
                          advantages=[1.0, -0.5][: len(pick)], execution_index=pick, temperature=0.9)


def _trainer(backend):
    cfg = TrainConfig(backend=backend, dtype="float32", lr=1e-2, adam_eps=1.0)
    hf = random_qwen2(seed=0, std=0.1)
    if backend == "megatron":
        from gyre.train.megatron_trainer import MegatronTrainer

        return MegatronTrainer(cfg, hf.config, hf.state_dict())
    from gyre.train.trainer import EmbeddedTrainer

    return EmbeddedTrainer(cfg, hf)


@pytest.mark.parametrize("backend", ["embedded", "megatron"])
def test_flat_gradients_summed_outside_apply_exactly(backend):
    """Two replicas' flat gradients, summed and applied, give the step of one trainer doing both
    micro-batches; clearing leaves the trainer between steps (offload works)."""
    one, two = _trainer(backend), _trainer(backend)
    a, b = _batch([0]), _batch([1])
    one.forward_backward(a)
    one.forward_backward(b)
    ref = one.optimizer_step()

    assert float(two.flat_grads().abs().sum()) == 0  # nothing accumulated yet: zeros
    two.forward_backward(a)
    ga = two.flat_grads()
    two.clear_gradients()
    two.forward_backward(b)
    gb = two.flat_grads()
    two.clear_gradients()
    assert ga.shape == (two.num_grad_elements(),) and ga.dtype == torch.float32
    two.offload()  # between steps again
    two.restore()
    two.set_flat_grads(ga + gb)
    out = two.apply_gradients()
    assert out["step"] == 1 and out["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-6)
    pa, pb = one.hf_state_dict(), two.hf_state_dict()
    assert max(float((pa[k] - pb[k]).abs().max()) for k in pa) <= 1e-6
    with pytest.raises(ValueError, match="flat gradients have shape"):
        two.set_flat_grads(torch.zeros(3))


def test_wire_round_trip_is_exact_and_checked():
    mb = _batch()
    wire = to_wire(mb)
    assert all(isinstance(v, (np.ndarray, float)) for v in wire.values())
    back = from_wire(wire)
    for name in MicroBatch.__dataclass_fields__:
        x, y = getattr(mb, name), getattr(back, name)
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
    del wire["target_ids"]
    with pytest.raises(ValueError, match="target_ids"):
        from_wire(wire)


@pytest.mark.slow
def test_trainer_process_survives_nothing_but_reports_everything(tmp_path):
    """A two-rank cell trainer: requests reach every rank, a rank's death is the trainer's."""
    from gyre.model.tiny import ensure_tiny_model
    from gyre.train.export import load_hf_dir
    from gyre.cell.trainer_process import TrainerDied, TrainerError, TrainerProcess

    model = ensure_tiny_model(tmp_path / "tiny")
    tp = TrainerProcess(TrainConfig(dtype="float32"), model, offloaded=True, timeout_s=60, ranks=2)
    try:
        ticks = []
        tp.wait_ready(on_wait=lambda: ticks.append(1))
        assert tp.step == 0 and tp.num_grad_elements > 0 and len(tp.pids) == 2
        assert len(tp.hostnames()) == 2
        with pytest.raises(TrainerError, match="rank 0.*(offload only between steps|already offloaded)"):
            tp.offload()  # an error in the trainer: the processes stay usable
        tp.restore()
        stats = tp.forward_backward(to_wire(_batch()), 0)
        assert stats["targets"] == _batch().num_targets  # rows split over the ranks, stats merged
        tp.stash(0)
        red = tp.reduce(0, [0], 1)
        assert red.grad_norm_total > 0 and not red.cached
        assert tp.reduce(0, [0], 2).cached  # the same membership: the cached group
        out = tp.apply(0)
        assert out.step == 1 == tp.step and out.grad_norm == pytest.approx(red.grad_norm_total, rel=1e-5)
        tp.save_checkpoint(tmp_path / "ckpt")
        tp.load_checkpoint(tmp_path / "ckpt")
        tp.offload()  # loaded tensors are releasable (Trainer.own_storage)
        tp.restore()
        tp.export_weights(tmp_path / "w1", tp.step)
        assert sorted(p.name for p in (tmp_path / "w1").glob("*.safetensors")) == [
            "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        assert load_hf_dir(tmp_path / "w1")[1].keys()  # the index and both pieces load
        os.kill(tp.pids[1], signal.SIGKILL)  # not rank 0: the cell's trainer is dead all the same
        with pytest.raises(TrainerDied, match="rank 1 died .*SIGKILL"):
            tp.forward_backward(to_wire(_batch()), 1)
        assert not tp.alive()
    finally:
        tp.close()


def test_rows_split_over_ranks_sum_to_the_whole_micro_batch():
    from gyre.cell.trainer_rank import merge_logprobs, merge_stats, rows_of, targets_of
    from gyre.train.trainer import EmbeddedTrainer

    mb = _batch()
    one = EmbeddedTrainer(TrainConfig(dtype="float32"), random_qwen2(seed=0, std=0.1))
    two = EmbeddedTrainer(TrainConfig(dtype="float32"), random_qwen2(seed=0, std=0.1))
    ref = one.forward_backward(mb)
    parts = [two.forward_backward(rows_of(mb, r, 2)) for r in range(2)]
    assert rows_of(_batch([0]), 1, 2) is None  # a rank with no row has nothing to do
    merged = merge_stats(parts)
    assert merged["targets"] == ref["targets"] and merged["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    # (atol 1e-6: the default off_policy (tis) weights tokens up to is_cap, so the gradient and its
    # float32 rounding across row splits are a few times larger than the plain ratio's)
    assert torch.allclose(one.flat_grads(), two.flat_grads(), atol=1e-6)
    # pi_prox (train.minibatches_per_step): each rank's rows' log-probs, put back in target order
    lp = [(targets_of(mb, r, 2), two.logprobs(rows_of(mb, r, 2)).numpy()) for r in range(2)]
    assert [len(i) for i, _ in lp] == [3, 2]  # rank 0 has row 0's 3 targets, rank 1 row 1's 2
    assert np.allclose(merge_logprobs(lp + [None]), one.logprobs(mb).numpy(), atol=1e-6)


@pytest.mark.slow
def test_two_cells_of_two_ranks_reduce_to_one_process(tmp_path):
    """N cells x M ranks (2 x 2, gloo) over a cross-cell group give the update of one process
    doing every micro-batch; the group is formed once per membership and then cached."""
    from concurrent.futures import ThreadPoolExecutor

    from gyre.model.tiny import ensure_tiny_model
    from gyre.train.export import load_hf_dir
    from gyre.cell.groups import serve_store
    from gyre.train.trainer import EmbeddedTrainer
    from gyre.cell.trainer_process import TrainerProcess

    model = ensure_tiny_model(tmp_path / "tiny")
    cfg = TrainConfig(dtype="float32", lr=1e-2, adam_eps=1.0)
    store = serve_store()
    cells = [TrainerProcess(cfg, model, cell=c, ranks=2, store=("127.0.0.1", store.port), timeout_s=600)
             for c in (0, 1)]
    data = [_batch(), _batch([1, 0])]
    try:
        for t in cells:
            t.wait_ready()
        ref = EmbeddedTrainer(cfg, model)
        with ThreadPoolExecutor(2) as pool:
            for step in range(2):
                for t, mb in zip(cells, data):
                    t.forward_backward(to_wire(mb), step)
                    t.stash(step)
                    ref.forward_backward(mb)
                red = list(pool.map(lambda t: t.reduce(step, [0, 1], 1), cells))
                assert red[0].cached == red[1].cached == (step == 1)
                if step == 0:
                    assert all(r.form_ms > 0 for r in red)
                out = [t.apply(step) for t in cells]
                want = ref.optimizer_step()
                assert out[0].grad_norm == out[1].grad_norm == pytest.approx(want["grad_norm"], rel=1e-5)
        cells[0].export_weights(tmp_path / "w", 2)
        got, exp = load_hf_dir(tmp_path / "w")[1], ref.hf_state_dict()
        assert max(float((got[k] - exp[k]).abs().max()) for k in exp) <= 1e-6
    finally:
        for t in cells:
            t.close()
