"""GPU check of the hybrid families (issue 30), run by benchmarks/gpu_check.sh on the device:

* Gyre's tiny Qwen3.5-MoE on CUDA: tree layout (FlexAttention for the full-attention layer, the
  state forked at branch points for the linear ones) vs expanded layout, loss and gradients, in
  float32 and under bf16 autocast;
* Megatron-Core's GatedDeltaNet through `gyre.train.megatron_gdn.tree_forward` on CUDA (the
  flash-linear-attention kernel when installed, else Megatron's torch fallback) vs Gyre's layer.
Writes benchmarks/results/hybrid_gpu.json (flat; rewritten after each part, so a run stopped by its
timeout keeps what it had; $GYRE_GPU_RESULTS overrides the folder). About a minute. `--dry-run`
runs the same code on the CPU, the bf16 pass in float32 (the CPU tree attention takes no bf16),
and writes only where $GYRE_GPU_RESULTS is set.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from gyre.config import TrainConfig  # noqa: E402
from gyre.train.gated_deltanet import TreeScan  # noqa: E402
from gyre.train.hybrid import HybridLM  # noqa: E402
from gyre.train.toy import random_model, tiny_config  # noqa: E402
from gyre.train.trainer import EmbeddedTrainer  # noqa: E402
from gyre.traj.materialize import materialize, prepare_step  # noqa: E402
from gyre.traj.record import ExecutionRecord  # noqa: E402
from gyre.traj.select import SelectionSpec  # noqa: E402
from gyre.traj.synthetic import Lengths, Shape, generate  # noqa: E402

VOCAB = 96
DRY = "--dry-run" in sys.argv
DEV = "cpu" if DRY else "cuda"


def tree_vs_expanded(dtype: str) -> float:
    if DRY:
        dtype = "float32"
    recs = []
    for i in range(2):
        shape = Shape(calls=16, subagents=1, subagent_calls=3, compactions=1, retries=1, parallel_every=2,
                      system=Lengths(40), task=Lengths(20), assistant=Lengths(12), tool=Lengths(16),
                      summary=Lengths(20), seed=i)
        tree = generate(shape).tree
        for n in tree.nodes:
            n.tokens = (n.tokens % (VOCAB - 1) + 1).astype(np.int32)
        recs.append(ExecutionRecord(f"e{i}", "t", 0, "done", float(i), "tests", tree=tree))
    step = prepare_step(recs, SelectionSpec(k="all"), step_version=0)
    hf = random_model(tiny_config("qwen3_5_moe", vocab_size=VOCAB), seed=1, std=0.2)
    grads = {}
    for layout in ("tree", "expanded"):
        t = EmbeddedTrainer(TrainConfig(dtype=dtype, clip=False, moe_aux_loss_coef=0.0), hf, device=DEV,
                            attention="tree")
        for mb in materialize(step.executions, layout=layout, micro_batch_tokens=1 << 14):
            t.forward_backward(mb)
        grads[layout] = t.flat_grads()
    ref = grads["expanded"]
    return float((grads["tree"] - ref).abs().max() / ref.abs().max())


def megatron_layer() -> dict:
    from gyre.train.dist import init_megatron

    init_megatron(seed=0)
    from megatron.core.ssm import gated_delta_net as mgdn

    from gyre.train.megatron_gdn import build_layer, load_from_gyre, tree_forward

    hf = random_model(tiny_config("qwen3_5"), seed=2, std=0.2)
    ours = HybridLM.from_transformers(hf).model.layers[0].linear_attn.to(DEV)
    layer = build_layer(ours.spec).to(DEV)
    load_from_gyre(layer, ours)
    kv = torch.zeros(31, dtype=torch.long)
    for a, b, end in ((0, 10, 28), (10, 16, 23), (16, 20, 20), (20, 23, 23), (23, 28, 28)):
        kv[a:b] = end
    tree = TreeScan.build(kv[None].to(DEV))
    x = torch.randn(1, 31, 64, device=DEV)
    with torch.no_grad():
        want = ours(x, tree)
        got = tree_forward(layer, x.transpose(0, 1), tree)[0].transpose(0, 1)
    return {"megatron_gdn_tree_max_abs_diff": float((got - want)[:, :28].abs().max()),
            "megatron_gdn_kernel": "fla" if mgdn.chunk_gated_delta_rule is not None else "torch_fallback"}


def main() -> dict:
    if not DRY and not torch.cuda.is_available():
        raise SystemExit("hybrid_gpu_check: no CUDA device; use --dry-run to check the script on the CPU")
    env = os.environ.get("GYRE_GPU_RESULTS")
    dest = Path(env) / "hybrid_gpu.json" if env else None if DRY else ROOT / "benchmarks" / "results" / "hybrid_gpu.json"
    out: dict = {"device": "cpu (dry run)" if DRY else torch.cuda.get_device_name()}

    def put(**kv) -> None:
        out.update(kv)
        if dest is not None:
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(json.dumps(out, indent=2) + "\n")

    put(tree_vs_expanded_grad_max_abs_diff_fp32=tree_vs_expanded("float32"))
    put(tree_vs_expanded_grad_max_abs_diff_bf16=tree_vs_expanded("bfloat16"))
    put(**megatron_layer())
    put(ok=out["tree_vs_expanded_grad_max_abs_diff_fp32"] < 1e-3 and out["megatron_gdn_tree_max_abs_diff"] < 1e-3)
    print(json.dumps(out))
    assert out["ok"], out
    return out


if __name__ == "__main__":
    main()
