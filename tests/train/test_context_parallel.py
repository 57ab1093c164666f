"""Context parallelism for expanded rows (gyre/train/context_parallel.py): the THD packing and the
per-rank partition, checked against Megatron-Core's own slicing functions, and the configuration
rule that refuses tree rows. The trainer's CP forward needs CUDA and Transformer Engine
(benchmarks/gpu_check.sh, two GPUs)."""

from __future__ import annotations

import pytest
import torch

from gyre.batch import MicroBatch, expanded_batch
from gyre.config import ConfigError, load_config
from gyre.train import context_parallel as cpar
from support.gloo_ranks import spawned_ranks


def _batch(lengths: list[int], prompt: int = 2, seed: int = 0) -> MicroBatch:
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(1, 90, (n,), generator=g).tolist() for n in lengths]
    n_targets = [n - prompt for n in lengths]
    return expanded_batch(seqs, [prompt] * len(seqs), old_logprobs=[[-1.0] * t for t in n_targets],
                          advantages=[float(i) for i in range(len(seqs))], execution_index=list(range(len(seqs))))


def _pack(mb: MicroBatch, cp: int) -> cpar.PackedRows:
    return cpar.pack_rows(mb.input_ids, mb.position_ids, mb.kv_end, cp)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_every_token_on_exactly_one_rank_and_padding_to_2cp(cp):
    mb = _batch([13, 5, 32, 1])
    packed = _pack(mb, cp)
    padded = packed.cu_seqlens_padded[1:] - packed.cu_seqlens_padded[:-1]
    real = packed.cu_seqlens[1:] - packed.cu_seqlens[:-1]
    assert real.tolist() == [13, 5, 32, 1]
    assert all(p % (2 * cp) == 0 and r <= p < r + 2 * cp for p, r in zip(padded.tolist(), real.tolist()))
    held = torch.cat([cpar.rank_slots(packed, r) for r in range(cp)])
    assert sorted(held.tolist()) == list(range(packed.num_slots))  # every slot once, padding included
    real_held = packed.source[held]
    real_held = real_held[real_held >= 0]
    B, S = mb.input_ids.shape
    expected = [b * S + i for b, n in enumerate([13, 5, 32, 1]) for i in range(n)]
    assert sorted(real_held.tolist()) == expected  # every real token once
    real = packed.source >= 0
    assert torch.equal(packed.input_ids[real], mb.input_ids.reshape(-1)[packed.source[real]])


@pytest.mark.parametrize("cp", [2, 3])
def test_rank_r_holds_chunks_r_and_2cp_minus_1_minus_r(cp):
    packed = _pack(_batch([2 * cp * 3, 7]), cp)
    for r in range(cp):
        slots = cpar.rank_slots(packed, r).tolist()
        expected = []
        for start, end in zip(packed.cu_seqlens_padded[:-1].tolist(), packed.cu_seqlens_padded[1:].tolist()):
            c = (end - start) // (2 * cp)
            chunks = [list(range(start + j * c, start + (j + 1) * c)) for j in range(2 * cp)]
            expected += chunks[r] + chunks[2 * cp - 1 - r]
        assert slots == expected
    rank, local = cpar.slot_owner(packed)  # the closed-form inverse agrees with the slot lists
    for r in range(cp):
        slots = cpar.rank_slots(packed, r)
        assert (rank[slots] == r).all() and local[slots].tolist() == list(range(len(slots)))


class _Group:
    """What Megatron reads off a context-parallel process group: its size and this rank."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _toy_logprob(position: torch.Tensor, token: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A per-position function of what a rank holds at a row (its position and token) and the target."""
    return -(torch.sin(position.double() * 0.37 + token.double() * 0.11) + target.double() * 0.01) ** 2


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_reassembled_logprobs_equal_the_unsplit_ones(cp):
    mb = _batch([29, 6, 17, 3], prompt=2, seed=cp)
    B, S = mb.input_ids.shape
    whole = _toy_logprob(mb.position_ids.reshape(-1)[mb.pred_pos], mb.input_ids.reshape(-1)[mb.pred_pos],
                         mb.target_ids)
    packed = _pack(mb, cp)
    plans = [cpar.plan_rank(packed, r, mb.pred_pos, B * S) for r in range(cp)]
    assert sum(len(s.target_index) for s in plans) == mb.num_targets
    for s in plans:  # every rank's plan knows every rank's targets (the gather needs them), alike
        assert [i.tolist() for i in s.rank_targets] == [p.target_index.tolist() for p in plans]
    assert sum(s.num_tokens for s in plans) == mb.num_tokens
    locals_ = [_toy_logprob(s.position_ids[0, s.target_rows], s.input_ids[0, s.target_rows],
                            mb.target_ids[s.target_index]) for s in plans]
    for r, s in enumerate(plans):  # what each rank would return, gathered as torch.distributed does
        width = max(len(x) for x in locals_)
        padded = [torch.cat([x, x.new_full((width - len(x),), float("nan"))]) for x in locals_]
        got = cpar.gather_target_logprobs(locals_[r], s, lambda t, p=padded: p)
        assert torch.equal(got, whole)


def test_the_trainers_cp_forward_refuses_to_run_without_the_micro_batchs_plan():
    """The CP forward takes its THD tokens from the plan forward_backward / logprobs made; called
    outside them it says so rather than planning again."""
    from gyre.train.megatron_trainer import MegatronTrainer

    trainer = MegatronTrainer.__new__(MegatronTrainer)  # no Megatron state: the check comes first
    trainer._plan = None
    with pytest.raises(RuntimeError, match=r"inside forward_backward\(\) or logprobs\(\)"):
        trainer._cp_hidden(_batch([6, 4]))


def test_scatter_back_refuses_a_target_on_two_ranks_or_none():
    with pytest.raises(ValueError, match="on no rank"):
        cpar.scatter_back(3, [(torch.tensor([0, 1]), torch.ones(2)), (torch.tensor([1]), torch.ones(1))])


def test_matches_megatrons_get_batch_on_this_cp_rank(monkeypatch):
    """A single unpadded row (length a multiple of 2cp): Megatron's non-packed split, which the THD
    layout reduces to for one sequence, gives every rank the same tokens and positions."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    cp, n = 3, 24
    mb = _batch([n], seed=4)
    packed = _pack(mb, cp)
    assert packed.num_slots == n  # no padding: the non-packed split applies

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    for r in range(cp):
        theirs = get_batch_on_this_cp_rank({"tokens": mb.input_ids.clone(), "position_ids": mb.position_ids.clone()},
                                           cp_group=_Group(cp, r))
        ours = cpar.plan_rank(packed, r, mb.pred_pos, n)
        assert torch.equal(theirs["tokens"], ours.input_ids)
        assert torch.equal(theirs["position_ids"], ours.position_ids)


def test_megatron_thd_rope_rotates_each_local_token_at_its_own_position():
    """The trainer hands Megatron the whole stream's RoPE angles; Megatron's THD RoPE (CPU
    implementation, `_apply_rotary_pos_emb_thd`) cuts each rank's chunks out of them. Rotating the
    local rows that way equals rotating the whole stream and then taking the rank's rows."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    cp, dim = 2, 8
    mb = _batch([11, 20, 4], seed=7)
    packed = _pack(mb, cp)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).double() / dim))
    freqs = packed.position_ids.double()[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), -1)[:, None, None, :]  # [P, 1, 1, dim], as PositionalRotaryEmbedding
    x = torch.randn(packed.num_slots, 2, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def rotate(t, e):
        half = t.shape[-1] // 2
        rot = torch.cat((-t[..., half:], t[..., :half]), -1)
        return t * e.cos() + rot * e.sin()

    whole = rotate(x, emb[:, 0])

    for r in range(cp):
        slots = cpar.rank_slots(packed, r)
        local = _apply_rotary_pos_emb_thd(x[slots], packed.cu_seqlens_padded, emb, cp_group=_Group(cp, r))
        assert torch.allclose(local, whole[slots], atol=1e-12)


def test_a_tree_row_is_refused_with_the_fix():
    mb = _batch([6, 4])
    kv_end = mb.kv_end.clone()
    kv_end[0, 2] = 3  # token 2 seen only by itself: a branch, as in a tree-packed row
    with pytest.raises(cpar.NotCausalRowError, match='row 0 .*train.layout = "expanded".*train.context_parallel = 1'):
        cpar.pack_rows(mb.input_ids, mb.position_ids, kv_end, 2)


def test_select_targets_keeps_rows_and_restricts_every_target_field():
    mb = _batch([9, 7])
    idx = torch.tensor([5, 0, 8])
    sub = cpar.select_targets(mb, idx)
    assert torch.equal(sub.input_ids, mb.input_ids) and torch.equal(sub.kv_end, mb.kv_end)
    for name in ("pred_pos", "target_ids", "old_logprobs", "advantages", "weights", "staleness",
                 "execution_index", "temperature"):
        assert torch.equal(getattr(sub, name), getattr(mb, name)[idx]), name
    sub.validate()


@pytest.mark.parametrize("overrides,needle", [
    (["train.context_parallel=0"], "train.context_parallel: 0 is below the minimum 1"),
    (["train.context_parallel=2", "train.backend=megatron"], 'set train.layout = "expanded" or keep '
                                                              "train.context_parallel = 1"),
    (["train.context_parallel=2", "train.layout=expanded"], 'needs train.backend = "megatron"'),
])
def test_config_refuses_what_context_parallelism_cannot_cut(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        load_config(None, overrides)


def test_config_takes_expanded_rows_under_megatron():
    cfg = load_config(None, ["train.context_parallel=4", "train.layout=expanded", "train.backend=megatron"])
    assert cfg.train.context_parallel == 4
    assert load_config(None, []).train.context_parallel == 1


def test_megatron_model_asks_for_transformer_engine():
    """The CP core attention is Transformer Engine's; without it the model says so (this machine)."""
    import importlib.util

    from gyre.train.dist import init_megatron

    init_megatron(seed=0)
    from gyre.model.families import ModelFormatError
    from gyre.train import megatron_model
    from gyre.train.toy import tiny_qwen2_config

    assert megatron_model.transformer_config(tiny_qwen2_config(), context_parallel=2).context_parallel_size == 2
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed here")
    with pytest.raises(ModelFormatError, match="Transformer Engine.*train.context_parallel = 1"):
        megatron_model.build_gpt_model(tiny_qwen2_config(), context_parallel=2)


# --- the trainer's CP path end to end on two gloo ranks (TE's attention replaced by a stand-in) ---

_CP_CFG = dict(lr=1e-3, dtype="float32", adam_eps=1.0, off_policy="none")
_CP_ROWS = ([23, 9, 14], 3)  # row lengths (not multiples of 2 x cp: padding), prompt


def _cp_batch() -> MicroBatch:
    lengths, prompt = _CP_ROWS
    mb = _batch(lengths, prompt=prompt, seed=11)
    mb.old_logprobs = torch.full_like(mb.old_logprobs, -4.5)
    return mb


_PLAN_STEPS = ("pack_rows", "target_owners")  # the costly steps of a micro-batch's CP plan


def _count_plan_steps() -> dict[str, int]:
    """Counts calls of the plan's costly steps from here on (in a spawned rank: nothing to undo)."""
    calls = dict.fromkeys(_PLAN_STEPS, 0)
    for name in _PLAN_STEPS:
        def counted(*args, _name=name, _fn=getattr(cpar, name), **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)
        setattr(cpar, name, counted)  # the trainer and plan_rank look them up on the module
    return calls


def _cp_rank(rank, port, hf_config, hf_state, out):
    from gyre.config import TrainConfig
    from gyre.train import megatron_model
    from gyre.train.dist import init_distributed
    from gyre.train.megatron_trainer import MegatronTrainer
    from support.cp_attention import AllGatherCPAttention

    torch.set_num_threads(1)
    init_distributed(rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    megatron_model.context_parallel_attention = lambda: AllGatherCPAttention  # TE's kernels are CUDA only
    state = {k: torch.from_numpy(v) for k, v in hf_state.items()}
    cfg = TrainConfig(backend="megatron", layout="expanded", context_parallel=2, **_CP_CFG)
    trainer = MegatronTrainer(cfg, hf_config, state)
    assert trainer.cp_size == 2 and trainer.cp_rank == rank
    mb = _cp_batch()
    calls = _count_plan_steps()
    logp = trainer.logprobs(mb)
    logprobs_calls = dict(calls)
    st = trainer.forward_backward(mb)
    fb_calls = {k: calls[k] - logprobs_calls[k] for k in calls}
    step = trainer.optimizer_step()
    params = {k: v.numpy().copy() for k, v in trainer.hf_state_dict().items()} if rank == 0 else None
    out.put(dict(rank=rank, logp=logp.numpy().copy(), stats={k: st[k] for k in ("loss", "targets", "tokens")},
                 grad_norm=step["grad_norm"], params=params,
                 plan_calls={"logprobs": logprobs_calls, "forward_backward": fb_calls}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def two_cp_ranks():
    """One run of two CP ranks shared by the tests below: (the HF model, its state, each
    rank's reply in rank order)."""
    from gyre.train.toy import random_qwen2

    hf = random_qwen2(seed=0, std=0.1)
    hf_state = {k: v.numpy().copy() for k, v in hf.state_dict().items()}
    return hf, hf_state, sorted(spawned_ranks(_cp_rank, hf.config, hf_state, replies=2), key=lambda r: r["rank"])


def test_megatron_trainer_with_two_cp_ranks_equals_one_process(two_cp_ranks):
    """Two CP ranks (gloo, the stand-in attention): every rank's gathered log-probs, the summed
    stats, the grad norm and the updated weights equal the embedded trainer's on the whole rows."""
    from gyre.config import TrainConfig
    from gyre.train.trainer import EmbeddedTrainer

    hf, hf_state, results = two_cp_ranks
    mb = _cp_batch()
    ref = EmbeddedTrainer(TrainConfig(**_CP_CFG), hf)
    want = ref.logprobs(mb)
    ref_st = ref.forward_backward(mb)
    ref_step = ref.optimizer_step()
    for r in results:
        logp = torch.from_numpy(r["logp"])
        assert torch.allclose(logp, want, atol=1e-5), (logp - want).abs().max()
        assert abs(r["grad_norm"] - ref_step["grad_norm"]) < 1e-4 * ref_step["grad_norm"]
    stats = [r["stats"] for r in results]
    assert all(s["targets"] > 0 for s in stats)  # both ranks predict targets: the split is real
    assert sum(s["targets"] for s in stats) == mb.num_targets
    assert sum(s["tokens"] for s in stats) == mb.num_tokens
    assert sum(s["loss"] for s in stats) == pytest.approx(ref_st["loss"], rel=1e-4)
    params = results[0]["params"]
    for k, v in ref.hf_state_dict().items():
        assert torch.allclose(v, torch.from_numpy(params[k]), atol=1e-6), k
    assert not torch.allclose(ref.hf_state_dict()["lm_head.weight"], torch.from_numpy(hf_state["lm_head.weight"]))


def test_the_cp_plan_is_built_once_per_micro_batch(two_cp_ranks):
    """logprobs (forward + all-gather) and forward_backward (forward + loss) each pack the rows and
    find the targets' owners once on every rank: the forward and the gather reuse that plan."""
    _, _, results = two_cp_ranks
    once = dict.fromkeys(_PLAN_STEPS, 1)
    for r in results:
        assert r["plan_calls"] == {"logprobs": once, "forward_backward": once}, r["rank"]
