"""Routing replay as a training option (train.routing_replay, issue 29 item 5): routed experts
stored per (node, policy version) in the tree, through a shard bit-exact, carried by micro-batches,
and replayed by the trainer's forwards; off = unchanged."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from gyre.batch import expanded_batch, from_wire, to_wire
from gyre.config import TrainConfig
from gyre.traj.materialize import materialize, prepare_step
from gyre.traj.record import ExecutionRecord
from gyre.traj.routing import MISSING, encode_routed_experts, record_call_routing
from gyre.traj.select import SelectionSpec
from gyre.traj.store import ShardWriter, read_shard
from gyre.traj.tree import Segment, TrajectoryTree
from gyre.train.toy import random_model, tiny_config
from gyre.train.trainer import EmbeddedTrainer

SHAPE = (2, 2, 8)  # MoE layers, top_k, experts
IDENTITY = {"tokenizer": "t", "model": "m"}


def _routing(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, SHAPE[2], (n, SHAPE[0], SHAPE[1])).astype("<i4")


def _two_version_tree() -> tuple[TrajectoryTree, list[np.ndarray]]:
    """Call 0 at version 0, call 1 at version 1 continuing through call 0's output."""
    tree, sent = TrajectoryTree(), []
    sys_seg = Segment("sys", [1, 2, 3, 4], "system")
    c0 = tree.add_call([sys_seg], "a0", [5, 6], [7, 8, 9], [-0.1, -0.2, -0.3], agent_role="main",
                       weight_version="0", policy_version=0)
    r0 = _routing(4 + 5 - 1, 0)
    sent.append(r0)
    record_call_routing(tree, c0, encode_routed_experts(r0), SHAPE)
    out0 = Segment("a0", [5, 6, 7, 8, 9], "assistant")
    c1 = tree.add_call([sys_seg, out0, Segment("u1", [10, 11], "user")], "a1", [12], [13, 14], [-0.4, -0.5],
                       agent_role="main", weight_version="1", policy_version=1)
    r1 = _routing(4 + 5 + 2 + 1 + 2 - 1, 1)
    sent.append(r1)
    record_call_routing(tree, c1, encode_routed_experts(r1), SHAPE)
    return tree, sent


def test_routed_experts_per_node_two_versions_and_shard_bit_exact(tmp_path):
    tree, (r0, r1) = _two_version_tree()
    t = tree.routing
    assert t.versions(0) == [0, 1]  # the shared system prefix, routed at two versions: two entries
    assert np.array_equal(t.entries[(0, 0)], r0[:4]) and np.array_equal(t.entries[(0, 1)], r1[:4])
    assert len(t.entries[(1, 0)]) == 4  # call 0's target: its last token was never run
    assert len(t.entries[(1, 1)]) == 5  # ... call 1 ran it
    assert t.entries[(0, 0)].dtype == np.uint8
    rec = ExecutionRecord("e0", "task", reward=1.0, tree=tree)
    plain = ExecutionRecord("e1", "task", reward=0.0)
    plain.tree.add_call([Segment("s", [1, 2], "system")], "x", [3], [4], [-1.0], agent_role="main")
    path = ShardWriter(tmp_path, identity=IDENTITY).write([rec, plain])
    back, other = read_shard(path)
    assert other.tree.routing is None
    assert back.tree.routing.entries.keys() == t.entries.keys()
    for k, v in t.entries.items():
        assert back.tree.routing.entries[k].dtype == v.dtype and np.array_equal(back.tree.routing.entries[k], v)
    # the engine's answer for each call is rebuilt from the shard exactly (replay of recorded calls)
    from gyre.traj.routing import path_lengths

    for call, sent in zip(back.tree.calls, (r0, r1)):
        assert np.array_equal(back.tree.routing.call_rows(path_lengths(back.tree, call.leaf), call.policy_version), sent)


def test_old_shard_without_routing_reads(tmp_path):
    rec = ExecutionRecord("e", "task", reward=1.0)
    rec.tree.add_call([Segment("s", [1, 2], "system")], "x", [3], [4, 5], [-1.0, -2.0], agent_role="main")
    path = ShardWriter(tmp_path, identity=IDENTITY).write([rec])
    import h5py

    with h5py.File(path) as f:
        assert "routing" not in f and "routed_experts" not in f
    assert read_shard(path)[0].tree.routing is None


def test_micro_batch_carries_each_nodes_routing():
    tree, (r0, r1) = _two_version_tree()
    rec = ExecutionRecord("e0", "task", reward=1.0, tree=tree)
    other = ExecutionRecord("e1", "task", reward=0.0, tree=_two_version_tree()[0])
    batch = prepare_step([rec, other], SelectionSpec(k="all"), step_version=1)
    mat = materialize(batch.executions, layout="expanded", micro_batch_tokens=4096, routing=True)
    mb = from_wire(to_wire(mat[0]))
    assert mb.routed_experts is not None and mb.routed_experts.shape[2:] == (2, 2)
    row = mb.routed_experts[0].numpy()  # the longest path: sys, a0 (target v0), u1, a1 (target v1)
    assert np.array_equal(row[:4], r1[:4])        # context: the newest entry
    assert np.array_equal(row[4:8], r0[4:8])      # call 0's target: its own call's routing ...
    assert np.array_equal(row[8], r1[8])          # ... its last position from the call that ran it
    assert np.array_equal(row[9:13], r1[9:13])
    assert (row[13] == MISSING).all()             # the leaf's last token was never run
    assert materialize(batch.executions, layout="expanded", micro_batch_tokens=4096)[0].routed_experts is None


@pytest.fixture(scope="module")
def moe_model():
    return random_model(tiny_config("qwen3_moe", experts=8, top_k=2), seed=3, std=0.3)


def _mb(routing=None):
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 96, (12,), generator=g).tolist() for _ in range(2)]
    mb = expanded_batch(seqs, [4, 4], old_logprobs=[[-4.0] * 8] * 2, advantages=[1.0, -1.0], execution_index=[0, 1])
    mb.routed_experts = routing
    return mb


def _loss(model, routing_replay: bool, mb) -> tuple[float, torch.Tensor]:
    trainer = EmbeddedTrainer(TrainConfig(lr=1e-3, dtype="float32", routing_replay=routing_replay), model,
                              device="cpu")
    stats = trainer.forward_backward(mb)
    grad = trainer.model.model.layers[0].mlp.gate.weight.grad.clone()
    return stats["loss"], grad


def test_replay_on_uses_the_stored_routing(moe_model):
    free_loss, free_grad = _loss(moe_model, False, _mb())
    own = EmbeddedTrainer(TrainConfig(dtype="float32"), moe_model, device="cpu")
    with torch.no_grad():
        own.model(_mb().input_ids)
    mine = torch.stack([layer.mlp.last_experts.view(2, 12, 2) for layer in own.model.model.layers], dim=2)
    same_loss, _ = _loss(moe_model, True, _mb(mine.to(torch.int16)))
    forced_loss, forced_grad = _loss(moe_model, True, _mb(((mine + 3) % 8).to(torch.int16)))
    assert same_loss == pytest.approx(free_loss, rel=1e-6)  # replaying its own routing: the same loss
    assert abs(forced_loss - free_loss) > 1e-3              # forced routing changes the loss
    assert forced_grad.abs().sum() > 0                      # the router still gets gradients
    # -1 rows route freely: all missing = free routing
    missing_loss, _ = _loss(moe_model, True, _mb(torch.full_like(mine, -1, dtype=torch.int16)))
    assert missing_loss == pytest.approx(free_loss, rel=1e-6)


def test_option_off_ignores_carried_routing(moe_model):
    other = torch.randint(0, 8, (2, 12, 2, 2), generator=torch.Generator().manual_seed(1)).to(torch.int16)
    assert _loss(moe_model, False, _mb(other))[0] == _loss(moe_model, False, _mb())[0]


def test_replay_on_a_dense_model_is_refused():
    dense = random_model(tiny_config("qwen3"), seed=1, std=0.2)
    with pytest.raises(ValueError, match="routing_replay"):
        EmbeddedTrainer(TrainConfig(dtype="float32", routing_replay=True), dense, device="cpu")


def test_engine_answers_routing_only_when_asked_and_at_the_end_of_a_stream(tmp_path, moe_model):
    from gyre.engine.client import EngineClient
    from support.inprocess_engine import InProcessEngine

    moe_model.save_pretrained(tmp_path)
    shutil.copyfile(Path(__file__).parents[2] / "gyre" / "assets" / "tokenizer.json", tmp_path / "tokenizer.json")
    params = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    with InProcessEngine(tmp_path, api_key="k") as eng:
        async def go():
            async with EngineClient(eng.url, api_key="k") as c:
                plain = await c.generate([5, 6, 7, 8], params)
                asked = await c.generate([5, 6, 7, 8], params, return_routed_experts=True)
                snaps = [s async for s in c.generate_stream([5, 6, 7, 8], params, return_routed_experts=True)]
                return plain, asked, snaps
        plain, asked, snaps = asyncio.run(go())
    assert "routed_experts" not in plain.meta_info  # as SGLang: only when the request asks
    assert "routed_experts" in asked.meta_info
    assert all("routed_experts" not in s.meta_info for s in snaps[:-1])
    assert snaps[-1].meta_info["routed_experts"] == asked.meta_info["routed_experts"]


@pytest.mark.slow
def test_proxy_asks_for_routing_and_stores_it_per_node(tmp_path):
    """The proxy on the tiny Qwen3-MoE behind the embedded engine: each call's routing (plain and
    streamed) lands per node, equal to the trainer's own routing of the same ids at the same weights."""
    from openai import OpenAI

    from support.inprocess_engine import InProcessEngine
    from gyre.engine.router import Router
    from gyre.model.tiny import ensure_tiny_model
    from gyre.model.tokenizer import load_tokenizer
    from gyre.proxy.routes import create_app, start_site
    from gyre.proxy.server import Proxy, routing_options
    from gyre.traj.routing import path_lengths
    from gyre.train.qwen2 import Qwen2LM
    from support.loop_thread import LoopThread

    model = ensure_tiny_model(tmp_path / "moe", "qwen3_moe")
    opts = routing_options(TrainConfig(routing_replay=True), model)
    assert opts == {"routing": (2, 2, 8)}
    lt = LoopThread()
    with InProcessEngine(model, api_key="k") as eng:
        async def up():
            router = Router([eng.url], api_key="k")
            proxy = Proxy(router, load_tokenizer(model), **opts)
            runner, port = await start_site(create_app(proxy, admin_key="a"), "127.0.0.1", 0)
            return router, proxy, runner, port
        router, proxy, runner, port = lt.run(up())
        try:
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=proxy.register("x"), max_retries=0)
            msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
            r = client.chat.completions.create(model="main", messages=msgs, max_tokens=6, temperature=1.0)
            msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
            list(client.chat.completions.create(model="main", messages=msgs, max_tokens=6, stream=True))
        finally:
            lt.run(runner.cleanup())
            lt.run(router.close())
            lt.close()
    tree = proxy.by_id["x"].tree
    assert len(tree.calls) == 2 and proxy.routing_missing == 0
    trainer = Qwen2LM.from_dir(model)
    for call in tree.calls:
        lengths = path_lengths(tree, call.leaf)
        assert all((n, call.policy_version) in tree.routing.entries for n, _ in lengths)
        got = tree.routing.call_rows(lengths, call.policy_version)
        ids = np.concatenate([tree.call_input_ids(call), tree.call_output_ids(call)])[:-1]
        with torch.no_grad():
            trainer(torch.as_tensor(ids, dtype=torch.long)[None])
        own = torch.stack([layer.mlp.last_experts for layer in trainer.model.layers], dim=1).numpy()
        assert np.array_equal(got, own)
    # the second call continued through the first at the same version: its prefix nodes kept one entry
    assert len(tree.routing.entries) == len(tree.nodes)


def test_a_resumed_execution_replays_each_calls_recorded_routing():
    from gyre.proxy.replay import Replay

    tree, sent = _two_version_tree()
    replay = Replay(tree)
    for call, rows in zip(tree.calls, sent):
        answer = asyncio.run(replay.match(tree.call_input_ids(call)).generate())
        assert answer.meta_info["routed_experts"] == encode_routed_experts(rows)


def test_a_shard_with_half_the_routing_is_refused(tmp_path):
    import h5py

    from gyre.traj.store import ShardError

    path = ShardWriter(tmp_path, identity=IDENTITY).write([ExecutionRecord("e", "t", reward=1.0,
                                                                           tree=_two_version_tree()[0])])
    with h5py.File(path, "a") as f:
        del f["routed_experts"]
    with pytest.raises(ShardError, match="routing"):
        read_shard(path, verify=False)
