"""Routing replay as a training option (issue 29 item 5), on the tiny Qwen3-MoE (8 experts, top-2).

Rollout: the embedded engine's forward (W0, float32) samples 16 executions of two calls each
(a 24-token prompt -> 16 sampled tokens; the second call continues the first with 8 new user
tokens -> 16 more), recording behaviour log-probs and the experts it routed every position to;
each call goes into a trajectory tree through ``record_call_routing`` exactly as the proxy
stores SGLang's ``meta_info.routed_experts``. Training: the embedded trainer takes one optimizer
step on that batch (lr 1e-3, ``train.routing_replay = true``), so the executions are one step
stale (lag 1, as with ``sched.staleness >= 1``) and the router logits have moved. At those W1
weights the same micro-batches (``materialize(routing=True)``) go through the trainer's real loss
(``off_policy = none``: the ratio and its clip are taken against the behaviour log-probs) once with
``train.routing_replay`` on and once off:

* ``routing_replay_mismatch_with`` / ``_without``: k3 estimate of KL(behaviour || trainer) per
  target token (the step statistics' ``mismatch_k3_lag1``);
* ``routing_replay_clip_frac_with`` / ``_without``: fraction of targets whose ratio was clipped;
* ``routing_replay_mismatch_lag0_with`` / ``_without``: the same at W0 (lag 0, float32 engine and
  trainer): the rollout -> tree -> shard -> micro-batch -> replay path reproduces the engine;
  ``routing_replay_mismatch_bf16_*``: at W0 with the trainer under bfloat16 autocast (numerics only);
* ``routing_replay_flip_fraction``: (token, MoE layer) pairs where the trainer's own top-k set at
  W1 differs from the engine's at W0;
* ``routing_replay_bytes_per_token``: stored routing bytes per unique tree token (uint8 ids).

The lag-1 clip fraction is large with or without replay: one lr 1e-3 step moves this tiny random
model far (weights dominate the mismatch there); the bf16 lag-0 pair isolates routing numerics.

Writes benchmarks/results/routing_replay.json. About 30 s on 2 cores (beside other work).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from gyre.config import TrainConfig  # noqa: E402
from gyre.engine.qwen import CausalLM  # noqa: E402
from gyre.traj.materialize import materialize, prepare_step  # noqa: E402
from gyre.traj.record import ExecutionRecord  # noqa: E402
from gyre.traj.routing import encode_routed_experts, record_call_routing  # noqa: E402
from gyre.traj.select import SelectionSpec  # noqa: E402
from gyre.traj.store import ShardWriter, read_shard  # noqa: E402
from gyre.traj.tree import Segment  # noqa: E402
from gyre.train.toy import random_model, tiny_config  # noqa: E402
from gyre.train.trainer import EmbeddedTrainer  # noqa: E402

EXECUTIONS, PROMPT, USER, OUTPUT, VOCAB = 16, 24, 8, 16, 96
EXPERTS, TOP_K, LR, SEED = 8, 2, 1e-3, 3


def _sample(engine: CausalLM, prompt: list[int], n: int, g: torch.Generator):
    """n tokens sampled at temperature 1; their log-probs and the routing of every position run."""
    cache = engine.new_cache()
    logits = engine.forward(prompt, cache)
    out, lps = [], []
    for i in range(n):
        lp = torch.log_softmax(logits.float(), -1)
        t = int(torch.multinomial(lp.exp(), 1, generator=g))
        out.append(t)
        lps.append(float(lp[t]))
        if i < n - 1:
            logits = engine.decode([t], [cache])[0]
    return out, lps, cache.routed_experts().numpy()  # [prompt + n - 1, MoE layers, top_k]


def rollout(engine: CausalLM, shape: tuple[int, int, int]) -> list[ExecutionRecord]:
    g = torch.Generator().manual_seed(SEED)
    records = []
    for e in range(EXECUTIONS):
        rec = ExecutionRecord(f"e{e}", "task", group=0, reward=float(e % 2))
        sys_ids = torch.randint(0, VOCAB, (PROMPT,), generator=g).tolist()
        out0, lp0, routed0 = _sample(engine, sys_ids, OUTPUT, g)
        c0 = rec.tree.add_call([Segment("sys", sys_ids, "system")], "a0", [], out0, lp0, agent_role="main",
                               weight_version="0", policy_version=0)
        record_call_routing(rec.tree, c0, encode_routed_experts(routed0), shape)
        user = torch.randint(0, VOCAB, (USER,), generator=g).tolist()
        out1, lp1, routed1 = _sample(engine, sys_ids + out0 + user, OUTPUT, g)
        c1 = rec.tree.add_call([Segment("sys", sys_ids, "system"), Segment("a0", out0, "assistant"),
                                Segment("u1", user, "user")], "a1", [], out1, lp1, agent_role="main",
                               weight_version="0", policy_version=0)
        record_call_routing(rec.tree, c1, encode_routed_experts(routed1), shape)
        records.append(rec)
    return records


def _stats(trainer: EmbeddedTrainer, mbs, lag: int) -> dict:
    """The loss's own statistics over the micro-batches (no optimizer step)."""
    parts = [trainer.forward_backward(mb) for mb in mbs]
    n = sum(s[f"mm_lag{lag}_n"] for s in parts)
    out = {"k3": sum(s[f"mm_lag{lag}_k3_sum"] for s in parts) / n,
           "clip_frac": sum(s["clip_frac"] * s["targets"] for s in parts) / sum(s["targets"] for s in parts)}
    trainer.clear_gradients()
    return out


def measure() -> dict[str, float]:
    torch.manual_seed(0)
    hf = random_model(tiny_config("qwen3_moe", experts=EXPERTS, top_k=TOP_K), seed=SEED, std=0.3)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        engine = CausalLM.from_dir(d)
        shape = (len(engine.spec.moe_layers), TOP_K, EXPERTS)
        writer = ShardWriter(Path(d) / "shards", identity={"model": "tiny-moe", "tokenizer": "none"})
        records = read_shard(writer.write(rollout(engine, shape)))  # routing through a shard, as trained

    def micro_batches(version: int) -> list:
        batch = prepare_step(records, SelectionSpec(k="all"), step_version=version)
        return list(materialize(batch.executions, layout="tree", micro_batch_tokens=4096, routing=True))

    cfg = dict(lr=LR, dtype="float32", off_policy="none")
    out: dict[str, float] = {}
    for tag, on in (("with", True), ("without", False)):  # at W0 (lag 0): the plumbing is exact
        for dtype, key in (("float32", "lag0"), ("bfloat16", "bf16")):
            trainer = EmbeddedTrainer(TrainConfig(**{**cfg, "dtype": dtype}, routing_replay=on), hf, device="cpu")
            s = _stats(trainer, micro_batches(0), 0)
            out[f"routing_replay_mismatch_{key}_{tag}"] = s["k3"]
    mbs = micro_batches(1)
    step = EmbeddedTrainer(TrainConfig(**cfg, routing_replay=True), hf, device="cpu")
    for mb in mbs:  # one optimizer step from W0: the router logits move
        step.forward_backward(mb)
    step.optimizer_step()
    w1 = {k: v.detach().clone() for k, v in step.model.state_dict().items()}
    for tag, on in (("with", True), ("without", False)):
        trainer = EmbeddedTrainer(TrainConfig(**cfg, routing_replay=on), step.model, device="cpu")
        trainer.model.load_state_dict(w1)
        s = _stats(trainer, mbs, 1)
        out[f"routing_replay_mismatch_{tag}"] = s["k3"]
        out[f"routing_replay_clip_frac_{tag}"] = s["clip_frac"]
    # how often the trainer's own routing at W1 differs from the engine's at W0
    flips = total = 0
    model = step.model
    with torch.no_grad():
        for mb in mbs:
            model(mb.input_ids, mb.position_ids, mb.attention_mask)
            own = torch.stack([layer.mlp.last_experts.view(*mb.input_ids.shape, TOP_K)
                               for layer in model.model.layers], dim=2)
            rec = mb.routed_experts.long()
            known = (rec >= 0).all(-1)
            diff = (own.sort(-1).values != rec.sort(-1).values).any(-1)
            flips += int((diff & known).sum())
            total += int(known.sum())
    stored = sum(v.nbytes for r in records for v in r.tree.routing.entries.values())
    unique = sum(len(n.tokens) for r in records for n in r.tree.nodes)
    out.update(routing_replay_flip_fraction=flips / total, routing_replay_bytes_per_token=stored / unique,
               routing_replay_lr=LR, routing_replay_targets=float(sum(mb.num_targets for mb in mbs)))
    return out


if __name__ == "__main__":
    torch.set_num_threads(2)
    print(json.dumps(measure(), indent=2))  # bench_token_truth.py merges these keys into token_truth.json
