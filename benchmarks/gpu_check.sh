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
rm -f benchmarks/results/ablation_gpu.json benchmarks/results/moe_gpu.json benchmarks/results/hybrid_gpu.json  # only this run's figures go back
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
# MoE (issue 20): Megatron bf16 MoE steps (alltoall dispatcher; grouped GEMM if Transformer Engine
# is there), engine/trainer log-probs after export, routing replay under bf16 -> moe_gpu.json
timeout -k 10 120 python3 benchmarks/moe_gpu_check.py || status=$?
# hybrid Gated DeltaNet families (issue 30): tree vs expanded on CUDA (FlexAttention + forked state,
# fp32 and bf16) and Megatron's GDN layer with the state in and out vs Gyre's -> hybrid_gpu.json
timeout -k 10 120 python3 benchmarks/hybrid_gpu_check.py || status=$?
for f in ablation_gpu.json moe_gpu.json hybrid_gpu.json; do
    if [ -n "${OUT:-}" ] && [ -f "benchmarks/results/$f" ]; then
        cp "benchmarks/results/$f" "$OUT/"
    fi
done
exit $status
