#!/usr/bin/env bash
# The trainer's GPU check (issue 11 item 8): Megatron-Core bf16 steps, offload/restore timing and
# log-prob agreement (trainer vs transformers vs the engine's sampling path) on one GPU, written
# to benchmarks/results/ablation_gpu.json (and copied to $OUT when the device tool sets it).
#
# The device machine has torch but no Megatron-Core and no network, so Megatron-Core travels as a
# wheel (pure dependencies torch, numpy, packaging are already there):
#
#   here, once, from the repo root:   benchmarks/gpu_check.sh fetch
#       downloads megatron-core for the device's Python 3.12 into .whl/ and git-ignores .whl/
#   on the device (the `run` tool):   command="benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=570
#
# The benchmarks are bounded to 9 minutes (timeouts 420 + 120 below). GYRE_WHEELS overrides .whl.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS="${GYRE_WHEELS:-.whl}"
MEGATRON="megatron-core==0.16.1"   # the version gyre/train/megatron_cpu.py and the tests were written against

if [ "${1:-}" = "fetch" ]; then
    exclude="$(git rev-parse --git-path info/exclude)"
    grep -qxF "/.whl/" "$exclude" 2>/dev/null || echo "/.whl/" >> "$exclude"
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$WHEELS" "$MEGATRON"
    ls -la "$WHEELS"
    exit 0
fi

if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible to python3's torch; run this on the device machine" >&2
    exit 2
fi
shopt -s nullglob
wheels=("$WHEELS"/megatron_core-*.whl)
if [ ${#wheels[@]} -eq 0 ]; then
    echo "gpu_check: no megatron_core wheel in $WHEELS; run '$0 fetch' here first and carry $WHEELS" >&2
    exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gyre-site \
    "${wheels[@]}"
export PYTHONPATH="/tmp/gyre-site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import megatron.core, torch; print('megatron-core', megatron.core.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv || true

status=0
rm -f benchmarks/results/ablation_gpu.json benchmarks/results/moe_gpu.json benchmarks/results/hybrid_gpu.json \
    benchmarks/results/cp_gpu.json  # only this run's figures go back
timeout -k 10 420 python3 benchmarks/bench_train_gpu.py || status=$?
# issue 21: pi_prox from the extra no-grad forward on CUDA in bf16, both backends. The no-grad
# forward runs in eval mode and the training one in train mode; at the same weights they must agree
# (prox_drift_max: bf16 kernels may differ in the last bits, not more), and the step must carry
# the mismatch figures. Prints one line per backend; fails on a drift above 0.05 nats.
timeout -k 10 120 python3 - <<'PY' || status=$?
import torch
from gyre.batch import expanded_batch
from gyre.config import TrainConfig
from gyre.train.megatron_trainer import MegatronTrainer
from gyre.train.toy import random_qwen2
from gyre.train.trainer import EmbeddedTrainer

hf = random_qwen2(seed=0, std=0.1)
seqs = [[1, 2, 3] + list(range(10, 40)), [4, 5] + list(range(50, 70))]
for name in ("embedded", "megatron"):
    cfg = TrainConfig(backend=name, dtype="bfloat16", off_policy="tis", lr=1e-4)
    t = EmbeddedTrainer(cfg, hf) if name == "embedded" else MegatronTrainer(cfg, hf.config, hf.state_dict())
    mb = expanded_batch(seqs, [3, 2], old_logprobs=[[0.0] * 30, [0.0] * 20], advantages=[1.0, -1.0],
                        execution_index=[0, 1])
    mb.old_logprobs = t.logprobs(mb)
    st = t.forward_backward(mb)
    out = t.optimizer_step()
    print(f"offpolicy_gpu {name}: prox_drift_max {st['prox_drift_max']:.3g} mismatch_k3_lag0 "
          f"{out['mismatch_k3_lag0']:.3g} grad_norm {out['grad_norm']:.3g}", flush=True)
    assert st["prox_drift_max"] < 0.05 and out["mismatch_k3_lag0"] < 0.01, (name, st, out)
PY
# routing replay as a training option (issue 29 item 5): train.routing_replay on CUDA in bf16, both
# backends (Megatron: RouterReplay on the grouped-GEMM experts when Transformer Engine is there),
# micro-batch routing with forced rows and -1 rows (routed freely: Megatron's RECORD pass). The two
# backends must agree within bf16 noise and replay must change the log-probs. One line per setting.
timeout -k 10 120 python3 - <<'PY' || status=$?
import torch
from gyre.batch import expanded_batch
from gyre.config import TrainConfig
from gyre.train.megatron_trainer import MegatronTrainer
from gyre.train.toy import random_model, tiny_config
from gyre.train.trainer import EmbeddedTrainer

hf = random_model(tiny_config("qwen3_moe", experts=8, top_k=2), seed=4, std=0.3)
g = torch.Generator().manual_seed(5)
seqs = [torch.randint(0, 96, (64,), generator=g).tolist() for _ in range(2)]
mb = expanded_batch(seqs, [8, 8], old_logprobs=[[-4.0] * 56] * 2, advantages=[1.0, -1.0], execution_index=[0, 1])
forced = torch.randint(0, 8, (2, 64, 2, 1), generator=g)
routing = torch.cat([forced, (forced + 1 + torch.randint(0, 6, forced.shape, generator=g)) % 8], dim=-1)
routing[:, ::3] = -1
mb.routed_experts = routing.to(torch.int16)
lp = {}
for on in (True, False):
    cfg = TrainConfig(dtype="bfloat16", routing_replay=on, lr=1e-4)
    lp["megatron", on] = MegatronTrainer(cfg, hf.config, hf.state_dict()).logprobs(mb)
    lp["embedded", on] = EmbeddedTrainer(cfg, hf).logprobs(mb)
    diff = float((lp["megatron", on] - lp["embedded", on]).abs().max())
    print(f"routing_replay_gpu replay={on}: megatron vs embedded max |dlogp| {diff:.3g}", flush=True)
    assert diff < 0.1, (on, diff)
changed = float((lp["embedded", True] - lp["embedded", False]).abs().max())
print(f"routing_replay_gpu: replay vs free max |dlogp| {changed:.3g}", flush=True)
assert changed > 0.05, changed
PY
# MoE (issue 20): Megatron bf16 MoE steps (alltoall dispatcher; grouped GEMM if Transformer Engine
# is there), engine/trainer log-probs after export, routing replay under bf16 -> moe_gpu.json
timeout -k 10 120 python3 benchmarks/moe_gpu_check.py || status=$?
# hybrid Gated DeltaNet families (issue 30): tree vs expanded on CUDA (FlexAttention + forked state,
# fp32 and bf16) and Megatron's GDN layer with the state in and out vs Gyre's -> hybrid_gpu.json
timeout -k 10 120 python3 benchmarks/hybrid_gpu_check.py || status=$?
# issue 28 (xLong training): the FlexAttention tree path (block masks from kv_end), train.recompute
# and chunked target log-probs on CUDA. (1) small rows: tree path + chunks == dense [B,S,V] logits
# for both backends (Megatron: recompute through its CheckpointFunction, target rows through the
# output layer and vocab-parallel cross entropy); (2) one step of a case-study-shaped tree row of
# ~150K tokens (tree layout, K = 5), printing its time and peak CUDA memory.
timeout -k 10 150 python3 - <<'PY' || status=$?
import time
import numpy as np
import torch
from gyre.batch import expanded_batch
from gyre.config import TrainConfig
from gyre.train.loss import token_logprobs
from gyre.train.megatron_trainer import MegatronTrainer
from gyre.train.toy import random_qwen2
from gyre.train.trainer import EmbeddedTrainer
from gyre.traj.materialize import materialize, prepare_step
from gyre.traj.select import SelectionSpec
from gyre.traj.synthetic import CASE_STUDY, generate, scaled

hf = random_qwen2(seed=0, std=0.1)
seqs = [[1, 2, 3] + list(range(10, 90)), [4, 5] + list(range(20, 60))]
for name in ("embedded", "megatron"):
    cfg = TrainConfig(backend=name, dtype="bfloat16", recompute=True, logprob_chunk=16, off_policy="none")
    t = EmbeddedTrainer(cfg, hf) if name == "embedded" else MegatronTrainer(cfg, hf.config, hf.state_dict())
    mb = expanded_batch(seqs, [3, 2], old_logprobs=[[0.0] * 80, [0.0] * 40], advantages=[1.0, -1.0],
                        execution_index=[0, 1])
    with torch.no_grad():
        full = token_logprobs(t._logits(mb.to(t.device)), mb.to(t.device)).cpu()
    got = t.logprobs(mb)
    st = t.forward_backward(mb)
    out = t.optimizer_step()
    d = float((got - full).abs().max())
    print(f"xlong_gpu {name}: chunked vs full logprobs max diff {d:.3g}, grad_norm {out['grad_norm']:.3g}", flush=True)
    assert d < 0.05 and np.isfinite(out["grad_norm"]), (name, d, out)

rec = generate(scaled(CASE_STUDY, 1.0))
vocab = hf.config.vocab_size
for n in rec.tree.nodes:
    n.tokens = (n.tokens % (vocab - 1) + 1).astype(np.int32)
step = prepare_step([rec], SelectionSpec(k=5), step_version=1, estimator="reward")
e = step.executions[0]
mat = materialize(step.executions, layout="tree", micro_batch_tokens=e.n_tokens)
t = EmbeddedTrainer(TrainConfig(dtype="bfloat16", recompute=True, logprob_chunk=4096, off_policy="none"), hf)
torch.cuda.reset_peak_memory_stats()
t0 = time.perf_counter()
for mb in mat:
    t.forward_backward(mb)
out = t.optimizer_step()
torch.cuda.synchronize()
print(f"xlong_gpu case study tree K=5: {e.n_tokens} tokens, {out['targets']} targets, "
      f"step {time.perf_counter() - t0:.1f} s, peak {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB", flush=True)
PY
# ---- issue 28 item 3: CONTEXT PARALLELISM (needs >= 2 GPUs and Transformer Engine) ------------
# train.context_parallel = N over N GPUs on expanded rows (THD, PackedSeqParams, TE's ring
# attention): log-probs vs the embedded trainer, the ranks' stats summing to the micro-batch's, the
# grad norm, a tree row refused -> cp_gpu.json. SKIPPED on the device lent to this project: it has
# ONE GPU (an H200), so this step has never run there; it runs as is on a node with two or more.
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ] && python3 -c "import transformer_engine" 2>/dev/null; then
    timeout -k 10 180 torchrun --standalone --nproc_per_node=2 benchmarks/cp_gpu_check.py || status=$?
else
    echo "context parallelism: SKIPPED ($gpus GPU(s) visible; needs >= 2 and Transformer Engine)"
fi
for f in ablation_gpu.json moe_gpu.json hybrid_gpu.json cp_gpu.json; do
    if [ -n "${OUT:-}" ] && [ -f "benchmarks/results/$f" ]; then
        cp "benchmarks/results/$f" "$OUT/"
    fi
done
exit $status
