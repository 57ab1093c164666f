"""GPU check of context parallelism for expanded rows (issue 28 item 3), run by
benchmarks/gpu_check.sh under `torchrun --nproc_per_node=N` (N >= 2 GPUs, Transformer Engine):

* MegatronTrainer with train.context_parallel = N on expanded rows whose lengths are not multiples
  of 2N (padding exercised): every rank's all-gathered target log-probs vs the embedded trainer
  on the whole rows (bf16 noise, < 0.1 nats);
* one forward/backward + optimizer step with pi_old = those log-probs: the CP ranks' stats sum to
  the micro-batch's targets and tokens, and the grad norm (gradients summed over the CP group by
  Megatron DDP) matches the embedded trainer's within 10%;
* a tree row is refused with the fix.
Rank 0 writes benchmarks/results/cp_gpu.json (flat). Never run on the CPU: TE's THD attention is
CUDA only.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from gyre.batch import expanded_batch  # noqa: E402
from gyre.config import TrainConfig  # noqa: E402
from gyre.train import context_parallel as cpar  # noqa: E402
from gyre.train.dist import init_distributed, init_megatron  # noqa: E402
from gyre.train.megatron_trainer import MegatronTrainer  # noqa: E402
from gyre.train.toy import random_qwen2  # noqa: E402
from gyre.train.trainer import EmbeddedTrainer  # noqa: E402


def main() -> int:
    init_distributed()  # env:// under torchrun; nccl
    cp = dist.get_world_size()
    init_megatron(context_parallel=cp, seed=0)
    hf = random_qwen2(seed=0, std=0.1)
    g = torch.Generator().manual_seed(3)
    lengths, prompt = [203, 64, 37], 5
    seqs = [torch.randint(1, hf.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    mb = expanded_batch(seqs, [prompt] * len(seqs), old_logprobs=[[-4.0] * (n - prompt) for n in lengths],
                        advantages=[1.0, -1.0, 0.5], execution_index=[0, 1, 2])
    common = dict(dtype="bfloat16", off_policy="none", lr=1e-4)
    ref = EmbeddedTrainer(TrainConfig(**common), hf)
    want = ref.logprobs(mb)
    mb.old_logprobs = want.clone()  # ratio 1: the whole loss is inside the clip, gradients flow
    cpt = MegatronTrainer(TrainConfig(backend="megatron", layout="expanded", context_parallel=cp, **common),
                          hf.config, hf.state_dict())
    got = cpt.logprobs(mb)
    diff = float((got - want).abs().max())

    st = cpt.forward_backward(mb)
    counts = torch.tensor([st["targets"], st["tokens"]], dtype=torch.long, device=cpt.device)
    dist.all_reduce(counts)  # the cell's merge of its ranks' stats sums these
    out = cpt.optimizer_step()
    ref.forward_backward(mb)
    ref_out = ref.optimizer_step()
    rel = abs(out["grad_norm"] - ref_out["grad_norm"]) / max(ref_out["grad_norm"], 1e-12)

    kv_end = mb.kv_end.clone()
    kv_end[0, 10] = 11  # a branch: token 10 seen by itself only, as in a tree-packed row
    try:
        cpar.pack_rows(mb.input_ids, mb.position_ids, kv_end, cp)
        refused = False
    except cpar.NotCausalRowError as e:
        refused = "train.layout" in str(e)

    result = {"cp_gpu_context_parallel": cp, "cp_gpu_tokens": mb.num_tokens, "cp_gpu_targets": mb.num_targets,
              "cp_gpu_logprob_max_diff_vs_embedded": diff,
              "cp_gpu_targets_summed": int(counts[0]), "cp_gpu_tokens_summed": int(counts[1]),
              "cp_gpu_grad_norm": out["grad_norm"], "cp_gpu_grad_norm_embedded": ref_out["grad_norm"],
              "cp_gpu_grad_norm_rel_diff": rel, "cp_gpu_tree_row_refused": refused,
              "cp_gpu_device": torch.cuda.get_device_name()}
    ok = (diff < 0.1 and int(counts[0]) == mb.num_targets and int(counts[1]) == mb.num_tokens
          and math.isfinite(out["grad_norm"]) and rel < 0.1 and refused)
    if dist.get_rank() == 0:
        print("cp_gpu:", json.dumps(result), "OK" if ok else "FAILED", flush=True)
        (ROOT / "benchmarks" / "results" / "cp_gpu.json").write_text(json.dumps(result, indent=1) + "\n")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
