"""Routing replay (optional item): the engine returns the experts it routed each position to
(SGLang's return_routed_experts, base64 int32 [tokens, MoE layers, top_k]), a cached prefix
included, and the trainer's forward can replay them."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest
import torch

from gyre.engine.qwen import CausalLM
from gyre.train.qwen2 import Qwen2LM
from gyre.train.toy import random_model, tiny_config


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")
    random_model(tiny_config("qwen3_moe", experts=8, top_k=2), seed=3, std=0.3).save_pretrained(d)
    return d


def _engine_routing(engine: CausalLM, ids: list[int]) -> torch.Tensor:
    cache = engine.new_cache()
    engine.forward(ids[:5], cache)
    for t in ids[5:]:
        engine.decode([t], [cache])
    return cache.routed_experts()


def test_engine_routing_equals_the_trainers_own(moe_dir):
    engine, trainer = CausalLM.from_dir(moe_dir), Qwen2LM.from_dir(moe_dir)
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(0))
    routed = _engine_routing(engine, ids[0].tolist())
    assert routed.shape == (12, 2, 2)
    trainer(ids)
    assert torch.equal(trainer.model.layers[1].mlp.last_experts, routed[:, 1].long())
    # a prefix copy keeps its positions' routing (the prefix cache answers for cached prompts)
    cache = engine.new_cache()
    engine.forward(ids[0].tolist(), cache)
    assert torch.equal(cache.copy(7).routed_experts(), routed[:7])


def test_replayed_routing_is_used_and_changes_logits(moe_dir):
    trainer = Qwen2LM.from_dir(moe_dir)
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        own = trainer(ids)
        trainer(ids)
        mine = torch.stack([l.mlp.last_experts.view(1, 12, 2) for l in trainer.model.layers], dim=2)
        same = trainer(ids, routed_experts=mine)
        other = (mine + 1) % 8  # different experts
        changed = trainer(ids, routed_experts=other)
        assert torch.equal(trainer.model.layers[0].mlp.last_experts, other[0, :, 0].long())
    assert torch.allclose(same, own, atol=1e-6)
    assert (changed - own).abs().max() > 1e-2
    assert trainer.model.layers[0].mlp.replay is None  # one forward only


def test_engine_http_returns_routed_experts(moe_dir):
    from gyre.engine.client import EngineClient
    from support.inprocess_engine import InProcessEngine
    import shutil
    from pathlib import Path

    shutil.copyfile(Path(__file__).parents[2] / "gyre" / "assets" / "tokenizer.json", moe_dir / "tokenizer.json")
    with InProcessEngine(moe_dir, api_key="k") as eng:
        async def go():
            async with EngineClient(eng.url, api_key="k") as c:
                return await c._request("POST", "/generate", {
                    "input_ids": [5, 6, 7, 8], "return_routed_experts": True,
                    "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}})
        out = asyncio.run(go())
    routed = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype="<i4").reshape(-1, 2, 2)
    assert routed.shape[0] == 4 + 3 - 1
    want = _engine_routing(CausalLM.from_dir(moe_dir), [5, 6, 7, 8] + out["output_ids"][:-1])
    assert np.array_equal(routed, want.numpy())


def test_megatron_router_replay_equals_the_embedded_replay(moe_dir):
    """Megatron's RouterReplay (forward replay) with the same routing gives the embedded module's
    logits; norm_topk_prob on (Qwen3-MoE) and off (Qwen2-MoE style pre-softmax routing)."""
    from gyre.batch import causal_mask
    from gyre.train.dist import init_megatron

    init_megatron(seed=0)
    from gyre.train import megatron_model

    for norm in (True, False):
        hf = random_model(tiny_config("qwen3_moe", experts=8, top_k=2, norm_topk_prob=norm), seed=4, std=0.3)
        ours = Qwen2LM.from_transformers(hf)
        mg = megatron_model.build_gpt_model(hf.config, routing_replay=True)
        megatron_model.load_hf_weights(mg, hf.state_dict(), hf.config)
        ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(2))
        other = torch.randint(0, 8, (2, 10, 2, 1), generator=torch.Generator().manual_seed(3))
        routing = torch.cat([other, (other + 1 + torch.randint(0, 6, other.shape)) % 8], dim=-1)  # 2 distinct
        pos, mask = torch.arange(10).expand(2, 10), causal_mask([10, 10], 10)
        with torch.no_grad():
            want = ours(ids, pos, mask, routed_experts=routing)
            got = mg.eval()(ids, pos, mask, routed_experts=routing)
            free = mg(ids, pos, mask)
        assert torch.allclose(got, want, atol=1e-4), (norm, (got - want).abs().max())
        assert (free - got).abs().max() > 1e-2  # the replayed routing is not what it would pick


def test_megatron_trainer_replays_micro_batch_routing_as_the_embedded_one():
    """train.routing_replay on both backends: the same micro-batch routing (forced rows, and -1
    rows the routers pick themselves) gives the same log-probs; off, the routing is ignored."""
    from gyre.batch import expanded_batch
    from gyre.config import TrainConfig
    from gyre.train.megatron_trainer import MegatronTrainer
    from gyre.train.trainer import EmbeddedTrainer

    hf = random_model(tiny_config("qwen3_moe", experts=8, top_k=2), seed=4, std=0.3)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 96, (10,), generator=g).tolist() for _ in range(2)]
    mb = expanded_batch(seqs, [3, 3], old_logprobs=[[-4.0] * 7] * 2, advantages=[1.0, -1.0], execution_index=[0, 1])
    forced = torch.randint(0, 8, (2, 10, 2, 1), generator=g)
    routing = torch.cat([forced, (forced + 1 + torch.randint(0, 6, forced.shape, generator=g)) % 8], dim=-1)
    routing[:, ::2] = -1  # not recorded: free routing there
    mb.routed_experts = routing.to(torch.int16)
    lp = {}
    for on in (True, False):
        cfg = TrainConfig(dtype="float32", routing_replay=on)
        lp["megatron", on] = MegatronTrainer(cfg, hf.config, hf.state_dict()).logprobs(mb)
        lp["embedded", on] = EmbeddedTrainer(cfg, hf, device="cpu").logprobs(mb)
    assert torch.allclose(lp["megatron", True], lp["embedded", True], atol=1e-4)
    assert torch.allclose(lp["megatron", False], lp["embedded", False], atol=1e-4)
    assert (lp["embedded", True] - lp["embedded", False]).abs().max() > 1e-2
