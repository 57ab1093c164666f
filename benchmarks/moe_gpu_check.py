"""MoE on one CUDA GPU (issue 20): Megatron-Core bf16 steps on a small random Qwen3-MoE (alltoall
dispatcher; grouped GEMM when Transformer Engine is installed), engine/trainer log-prob agreement
after export, and routing replay under bf16 (where numerics flip routes).

Writes benchmarks/results/moe_gpu.json (flat keys; $GYRE_GPU_RESULTS overrides the folder), first
after the steps and again at the end; run by benchmarks/gpu_check.sh. `--dry-run` runs the same
code on the CPU with a tiny model in float32 and writes only where $GYRE_GPU_RESULTS is set.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def _save(out: dict, dry_run: bool) -> None:
    env = os.environ.get("GYRE_GPU_RESULTS")
    if env or not dry_run:
        path = Path(env) if env else ROOT / "benchmarks" / "results"
        path.mkdir(parents=True, exist_ok=True)
        (path / "moe_gpu.json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


def main(dry_run: bool) -> dict:
    from gyre.batch import expanded_batch
    from gyre.config import TrainConfig
    from gyre.engine.qwen import CausalLM
    from gyre.model.spec import split_fused_experts
    from gyre.train.loss import token_logprobs
    from gyre.train.megatron_trainer import MegatronTrainer
    from gyre.train.qwen2 import Qwen2LM
    from gyre.train.toy import random_model, tiny_config

    big = not dry_run
    cfg = tiny_config("qwen3_moe", vocab_size=4096 if big else 96, hidden_size=512 if big else 64,
                      layers=8 if big else 2, heads=8 if big else 4, kv_heads=4 if big else 2,
                      experts=32 if big else 4, top_k=4 if big else 2, moe_intermediate_size=256 if big else 32)
    hf = random_model(cfg, seed=0, std=0.05)
    state = split_fused_experts({k: v.detach().clone() for k, v in hf.state_dict().items()})
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    trainer = MegatronTrainer(TrainConfig(lr=1e-4, dtype=dtype, moe_aux_loss_coef=1e-3), hf.config, state)
    g = torch.Generator().manual_seed(0)
    S = 512 if big else 24
    seqs = [torch.randint(0, cfg.vocab_size, (S,), generator=g).tolist() for _ in range(4)]
    mb = expanded_batch(seqs, [S // 2] * 4, old_logprobs=[[-4.0] * (S - S // 2)] * 4,
                        advantages=[1.0, -1.0, 0.5, -0.5], execution_index=[0, 1, 2, 3])
    out = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "dtype": dtype,
           "grouped_gemm": bool(getattr(trainer.model.config, "moe_grouped_gemm", False)),
           "dispatcher": trainer.model.config.moe_token_dispatcher_type}
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        trainer.forward_backward(mb)
        stats = trainer.optimizer_step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    out.update(step_s=min(times), tokens_per_s=4 * S / min(times), moe_aux_loss=stats.get("moe_aux_loss"),
               grad_norm=stats["grad_norm"])
    _save(out, dry_run)
    with tempfile.TemporaryDirectory() as d:
        trainer.export_weights(Path(d) / "w", weight_version=1)
        engine = CausalLM.from_dir(Path(d) / "w")
        mine = trainer.logprobs(mb)
        # prefill each row, then decode the four rows together, one batched call per position (the
        # engine runs on the CPU: 255 calls, not 4 x 255; run 3 on an H200 ran out of its 45 s here)
        caches = [engine.new_cache() for _ in seqs]
        lps = [[torch.log_softmax(engine.forward(s[: S // 2], c), -1)[s[S // 2]]] for s, c in zip(seqs, caches)]
        for k in range(S // 2, S - 1):
            logits = torch.log_softmax(engine.decode([s[k] for s in seqs], caches), -1)
            for i, s in enumerate(seqs):
                lps[i].append(logits[i, s[k + 1]])
        theirs = [float(x) for row in lps for x in row]
        routing = [c.routed_experts() for c in caches]
        old = torch.tensor(theirs)
        out["engine_trainer_logprob_diff"] = float((mine - old).abs().max())
        _save(out, dry_run)
        # routing replay under bf16: the embedded module on the device, own routing vs the engine's
        module = Qwen2LM.from_dir(Path(d) / "w").to(trainer.device)
        routed = torch.stack(routing)
        routed = torch.cat([routed, routed[:, -1:]], dim=1).to(trainer.device)
        ids = torch.tensor(seqs, device=trainer.device)
        for tag, replay in (("without", None), ("with", routed)):
            with torch.no_grad(), torch.autocast(trainer.device.type, dtype=torch.bfloat16,
                                                 enabled=torch.cuda.is_available()):
                logits = module(ids, routed_experts=replay)
            lp = token_logprobs(logits.float(), mb.to(trainer.device)).cpu()
            out[f"routing_replay_bf16_logprob_diff_{tag}"] = float((lp - old).abs().max())
    _save(out, dry_run)
    print(json.dumps(out, indent=1, sort_keys=True))
    return out


if __name__ == "__main__":
    dry = "--dry-run" in sys.argv
    if not dry and not torch.cuda.is_available():
        print("moe_gpu_check: no CUDA device; use --dry-run to check the script on the CPU")
        raise SystemExit(0)
    main(dry)
