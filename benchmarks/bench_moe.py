"""Model families on the CPU (issue 20): Gyre's forwards against transformers, the engine against
the trainer after a step, expert parallelism against one process, and chat-template conformance.

Per family (qwen2, llama, qwen3, qwen3_moe, qwen2_moe; tiny random models built offline):
  * ``<family>_logits_max_abs_diff``: embedded trainer module vs transformers (eager), a tree row;
  * ``<family>_engine_logits_max_abs_diff``: the engine's prefill + decode vs transformers, from a
    directory written by transformers' save_pretrained;
  * ``<family>_grad_max_abs_diff``: trainer gradients vs transformers' (relative to the largest);
  * ``<family>_megatron_logits_max_abs_diff``: Megatron-Core GPTModel (local spec) vs transformers;
  * ``<family>_engine_trainer_logprob_diff``: after one optimizer step, exported weights served by
    the engine vs the trainer's log-probs of the same tokens.
Then ``ep_reduce_matches_single`` (+ ``ep_max_param_diff``): Megatron MoE, expert parallel 2 over
gloo vs one process. Routing replay on the tiny Qwen3-MoE (8 experts, top-2): the engine's
behaviour log-probs and routing at W0 (fp32), then the trainer after one optimizer step (W1), with
its own routing vs the engine's replayed (lr 1e-3; ``..._lr1e-4_*`` at 1e-4): ``routing_replay_logprob_diff`` (max |trainer -
engine|, with replay), ``routing_replay_logprob_diff_without``, their ``_mean`` over targets, ``routing_flip_fraction`` (token-layer
pairs whose top-k set changed), and the same at W0 under bf16 autocast (``..._bf16_*``: the
numerics-only mismatch replay is meant for). ``template_conformance_<name>``: append-only per
test template.
Writes benchmarks/results/moe.json. About a minute on 2 cores.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from gyre.batch import expanded_batch  # noqa: E402
from gyre.config import TrainConfig  # noqa: E402
from gyre.engine.qwen import CausalLM  # noqa: E402
from gyre.model.spec import split_fused_experts  # noqa: E402
from gyre.train.qwen2 import Qwen2LM  # noqa: E402
from gyre.train.toy import random_model, tiny_config  # noqa: E402
from gyre.train.trainer import EmbeddedTrainer  # noqa: E402
from parity import engine_decode_diff, logits_and_grads  # noqa: E402

FAMILIES = ["qwen2", "llama", "qwen3", "qwen3_moe", "qwen2_moe"]
TEMPLATES = ["chatml_hermes", "chatml_drop_reasoning", "qwen3_coder_xml"]


def _tree_inputs(B=2, S=24, vocab=96):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    pos = torch.cat([torch.arange(16), torch.arange(8, 16)])[None].expand(B, S).contiguous()
    mask = torch.ones(S, S, dtype=torch.bool).triu(1)
    mask[16:, 8:16] = True
    return ids, pos, mask[None, None].expand(B, 1, S, S)


def family_figures(family: str, megatron) -> dict:
    hf = random_model(tiny_config(family), seed=1, std=0.2)
    ours = Qwen2LM.from_transformers(hf)
    ids, pos, mask = _tree_inputs()
    fmask = torch.zeros(mask.shape).masked_fill(mask, torch.finfo(torch.float32).min)
    want = hf(input_ids=ids, position_ids=pos, attention_mask=fmask).logits
    out = logits_and_grads(want, ours(ids, pos, mask), hf, ours)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        engine = CausalLM.from_dir(d)
        with torch.no_grad():
            ref_lp = torch.log_softmax(hf(input_ids=ids[:1, :16]).logits[0], -1)
        out["engine_logits_max_abs_diff"] = engine_decode_diff(engine, engine.new_cache(), ids[0, :16].tolist(), ref_lp, 10)
        # one optimizer step, export, serve: the engine's log-probs of the trained tokens vs the trainer's
        trainer = EmbeddedTrainer(TrainConfig(lr=1e-2, dtype="float32"), d)
        seqs = [ids[0].tolist(), ids[1].tolist()]
        mb = expanded_batch(seqs, [8, 8], old_logprobs=[[-4.0] * 16] * 2, advantages=[1.0, -1.0],
                            execution_index=[0, 1])
        trainer.forward_backward(mb)
        trainer.optimizer_step()
        trainer.export_weights(Path(d) / "w1", weight_version=1)
        served = CausalLM.from_dir(Path(d) / "w1")
        mine = trainer.logprobs(mb)
        theirs = []
        for s in seqs:
            c = served.new_cache()
            lp = [torch.log_softmax(served.forward(s[:8], c), -1)[s[8]]]
            for k in range(8, len(s) - 1):
                lp.append(torch.log_softmax(served.decode([s[k]], [c])[0], -1)[s[k + 1]])
            theirs += [float(x) for x in lp]
        out["engine_trainer_logprob_diff"] = float((mine - torch.tensor(theirs)).abs().max())
    if megatron is not None:
        model = megatron.build_gpt_model(hf.config)
        megatron.load_hf_weights(model, hf.state_dict(), hf.config)
        causal = torch.ones(24, 24, dtype=torch.bool).triu(1)[None, None].expand(2, 1, 24, 24)
        with torch.no_grad():
            mg = model.eval()(ids, torch.arange(24).expand(2, 24), causal)
            ref = hf(input_ids=ids).logits
        out["megatron_logits_max_abs_diff"] = float((mg - ref).abs().max())
    return out


def ep_figures() -> dict:
    """Megatron MoE, EP=2 over gloo (two processes) vs one process (tests/train/test_megatron_moe.py, tests/support/megatron_moe.py)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from support.megatron_moe import _CFG, _batch, _model, two_expert_parallel_ranks

    hf = _model()
    state = {k: v.numpy().copy() for k, v in split_fused_experts(hf.state_dict()).items()}
    grad_norm, _, _, ep_size, params = two_expert_parallel_ranks(hf, state)
    ref = EmbeddedTrainer(TrainConfig(**_CFG), hf)
    ref.forward_backward(_batch([0, 1, 2, 3], 4))
    stats = ref.optimizer_step()
    diff = max(float((v - torch.from_numpy(params[k])).abs().max()) for k, v in ref.hf_state_dict().items())
    return {"ep_size": ep_size, "ep_max_param_diff": diff, "ep_grad_norm_rel_diff": abs(stats["grad_norm"] - grad_norm) / grad_norm,
            "ep_reduce_matches_single": bool(diff < 1e-6 and abs(stats["grad_norm"] - grad_norm) < 1e-4 * grad_norm)}


def routing_replay_figures() -> dict:
    hf = random_model(tiny_config("qwen3_moe", experts=8, top_k=2), seed=3, std=0.3)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 96, (24,), generator=g).tolist() for _ in range(4)]
    out = {}
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        engine = CausalLM.from_dir(d)
        behaviour, routing = [], []
        for s in seqs:  # teacher-forced: prefill 8, then decode, recording log-probs and experts
            c = engine.new_cache()
            lp = [torch.log_softmax(engine.forward(s[:8], c), -1)[s[8]]]
            for k in range(8, len(s) - 1):
                lp.append(torch.log_softmax(engine.decode([s[k]], [c])[0], -1)[s[k + 1]])
            behaviour += [float(x) for x in lp]
            routing.append(c.routed_experts())
        routed = torch.stack(routing)  # [B, S-1, L, k]
        routed = torch.cat([routed, routed[:, -1:]], dim=1)  # the last position never runs: any experts
        mb = expanded_batch(seqs, [8] * 4, old_logprobs=[[-4.0] * 16] * 4, advantages=[1.0, -1.0, 0.5, -0.5],
                            execution_index=[0, 1, 2, 3])
        model = Qwen2LM.from_dir(d)
        ids = torch.tensor(seqs)
        old = torch.tensor(behaviour)

        def logprobs(routing_in, dtype=torch.float32):
            from gyre.train.loss import token_logprobs

            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                logits = model(ids, routed_experts=routing_in)
                own = torch.stack([layer.mlp.last_experts.view(4, 24, 2) for layer in model.model.layers], dim=2)
            return token_logprobs(logits.float(), mb), own

        w0 = {k: v.clone() for k, v in model.state_dict().items()}
        for tag, dtype, lr in (("bf16_", torch.bfloat16, None), ("", None, 1e-3), ("lr1e-4_", None, 1e-4)):
            if lr is not None:  # one optimizer step from W0 on the embedded trainer, then measure at W1
                model.load_state_dict(w0)
                trainer = EmbeddedTrainer(TrainConfig(lr=lr, dtype="float32"), model)
                trainer.forward_backward(mb)
                trainer.optimizer_step()
                model = trainer.model
            lp_own, own = logprobs(None, dtype or torch.float32)
            lp_rep, _ = logprobs(routed, dtype or torch.float32)
            flips = (own[:, :-1].sort(-1).values != routed[:, :-1].sort(-1).values).any(-1).float().mean()
            key = f"routing_replay_{tag}logprob_diff"
            out[key] = float((lp_rep - old).abs().max())
            out[key + "_without"] = float((lp_own - old).abs().max())
            out[key + "_mean"] = float((lp_rep - old).abs().mean())
            out[key + "_without_mean"] = float((lp_own - old).abs().mean())
            out[f"routing_{tag}flip_fraction"] = float(flips)
    return out


def main() -> dict:
    t0 = time.perf_counter()
    torch.set_num_threads(2)
    try:
        from gyre.train.dist import init_megatron

        init_megatron(seed=0)
        from gyre.train import megatron_model
    except Exception as e:  # noqa: BLE001 - the other figures still stand
        print(f"bench_moe: Megatron-Core unavailable ({e}); its figures are left out", file=sys.stderr)
        megatron_model = None
    out: dict = {}
    for fam in FAMILIES:
        for k, v in family_figures(fam, megatron_model).items():
            out[f"{fam}_{k}"] = v
    out.update(ep_figures())
    out.update(routing_replay_figures())
    from gyre.model.chat_template import ChatTemplate, conformance

    for name in TEMPLATES:
        c = conformance(ChatTemplate((ROOT / "tests" / "templates" / f"{name}.jinja").read_text()))
        out[f"template_conformance_{name}"] = c["append_only"]
        out[f"template_incremental_exact_{name}"] = c["incremental_exact"]
    out["wall_s"] = time.perf_counter() - t0
    path = ROOT / "benchmarks" / "results" / "moe.json"
    path.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(json.dumps(out, indent=1, sort_keys=True))
    return out


if __name__ == "__main__":
    main()
