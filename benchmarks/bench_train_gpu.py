"""Trainer on one CUDA GPU: bf16 Megatron steps, log-prob agreement, offload/restore timing.

Runs only where a GPU is available (exits 0 with a message otherwise); a few minutes at most.
Model: a random Qwen2 of ~0.2B parameters built in code (no hub). Measures
  * steps: Megatron bf16 forward/backward + optimizer step time and tokens/s on a toy batch;
  * agreement: trainer log-probs of recorded targets vs a transformers forward of the *exported*
    weights (fp32: should be exact up to kernel rounding; bf16: within bf16 noise), and vs the
    embedded engine sampling path (prefill + KV-cached decode) on the exported weights;
  * offload/restore: seconds and bytes per phase, GPU memory before/after, bit-identity after restore.
Writes benchmarks/results/ablation_gpu.json (flat keys; $GYRE_GPU_RESULTS overrides the folder),
rewritten after each part so a run stopped by its timeout keeps the parts it finished (`done` lists
them). `--part steps` measures all but the tree-attention timing, `--part tree` only that timing,
into tree_gpu.json (gpu_check.sh runs them as two stages, each under its own timeout); no --part:
both, into ablation_gpu.json. Run it on a device with `benchmarks/gpu_check.sh` (carries Megatron-Core as a wheel).
`--dry-run` runs the same code on the CPU with a tiny model and writes only where
$GYRE_GPU_RESULTS is set (to check the script itself where no GPU is lent).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from gyre.train.offload import sync  # noqa: E402

DRY = "--dry-run" in sys.argv
_DIR = os.environ.get("GYRE_GPU_RESULTS")
PART = sys.argv[sys.argv.index("--part") + 1] if "--part" in sys.argv else "all"
_NAME = "tree_gpu.json" if PART == "tree" else "ablation_gpu.json"
OUT = Path(_DIR) / _NAME if _DIR else None if DRY else ROOT / "benchmarks" / "results" / _NAME
DEV = "cpu" if DRY else "cuda"
STEPS, ROWS, SEQ = (2, 2, 64) if DRY else (5, 8, 1024)


def model_config():
    from gyre.train.toy import tiny_qwen2_config

    if DRY:
        return tiny_qwen2_config()
    return tiny_qwen2_config(vocab_size=32000, hidden_size=1024, layers=12, heads=16, kv_heads=4,
                             intermediate_size=2816)


def toy_sequences(vocab: int) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, vocab, (SEQ - 7 * i,), generator=g).tolist() for i in range(ROWS)]
    return seqs, [SEQ // 8] * ROWS


def toy_batch(vocab: int):
    from gyre.batch import expanded_batch

    seqs, plens = toy_sequences(vocab)
    old = [[-5.0] * (len(s) - p) for s, p in zip(seqs, plens)]
    adv = [1.0 if i % 2 == 0 else -1.0 for i in range(ROWS)]
    return expanded_batch(seqs, plens, old_logprobs=old, advantages=adv,
                          execution_index=list(range(ROWS)))


def trainer(dtype: str, hf_config, hf_state):
    from gyre.config import TrainConfig
    from gyre.train.megatron_trainer import MegatronTrainer

    # off_policy none: the step ablation_gpu.json was recorded with (no extra no-grad forward)
    return MegatronTrainer(TrainConfig(backend="megatron", lr=1e-5, dtype=dtype, off_policy="none"), hf_config, hf_state)


def agreement(t, mb, dtype: torch.dtype) -> dict:
    """Trainer log-probs vs transformers on the exported weights (what an engine would load)."""
    from transformers import AutoModelForCausalLM

    from gyre.train.loss import token_logprobs

    with tempfile.TemporaryDirectory() as d:
        t.export_weights(d, weight_version=1)
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=dtype, attn_implementation="eager").to(DEV).eval()
    mine = t.logprobs(mb)
    mb = mb.to(DEV)
    dense = mb.dense_mask()  # the micro-batch carries kv_end; transformers takes the S x S form
    mask = torch.zeros(dense.shape, dtype=dtype, device=DEV)
    mask.masked_fill_(dense, torch.finfo(dtype).min)
    with torch.no_grad():
        logits = hf(input_ids=mb.input_ids, position_ids=mb.position_ids,
                    attention_mask=mask, use_cache=False).logits
    ref = token_logprobs(logits, mb).cpu()
    diff = (mine - ref).abs()
    del hf
    return {"max_abs": float(diff.max()), "mean_abs": float(diff.mean()), "targets": mb.num_targets}


def engine_agreement(t, vocab: int, rows: int = 2, decode: int = 32) -> dict:
    """Trainer log-probs vs the behaviour log-probs the embedded engine computes while sampling the
    same tokens from the *exported* weights: prefill the prompt, then one KV-cached decode step per
    token, float32 on the CPU, through the engine's own log-prob function. (SGLang's CUDA stack
    cannot be carried to the device, so the embedded engine is the engine checked here.)"""
    from gyre.batch import expanded_batch
    from gyre.engine.qwen import CausalLM
    from gyre.engine.sampling import reported_logprobs

    seqs, plens = toy_sequences(vocab)
    seqs, plens = [s[:p + decode] for s, p in zip(seqs[:rows], plens[:rows])], plens[:rows]
    mb = expanded_batch(seqs, plens, old_logprobs=[[0.0] * decode] * rows, advantages=[1.0] * rows,
                        execution_index=list(range(rows)))
    mine = t.logprobs(mb)
    with tempfile.TemporaryDirectory() as d:
        t.export_weights(d, weight_version=1)
        lm = CausalLM.from_dir(d)
    ref = []
    for seq, p in zip(seqs, plens):
        cache = lm.new_cache()
        logits = lm.forward(seq[:p], cache)
        for tok in seq[p:]:
            ref.append(float(reported_logprobs(logits, 1.0)[tok]))  # temperature 1
            logits = lm.decode([tok], [cache])[0]
    diff = (mine - torch.tensor(ref)).abs()
    return {"max_abs": float(diff.max()), "mean_abs": float(diff.mean()), "targets": len(ref)}


def flat(d: dict, prefix: str = "") -> dict:
    """Nested results as one level of ``a.b.c`` keys (benchmarks write flat figures)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def run_steps(t, mb) -> dict:
    times, stats = [], []
    for _ in range(STEPS):
        sync()
        t0 = time.perf_counter()
        t.forward_backward(mb)
        s = t.optimizer_step()
        sync()
        times.append(time.perf_counter() - t0)
        stats.append(s)
    steady = times[1:] or times
    return {"step_s": times, "tokens_per_s": mb.num_tokens / (sum(steady) / len(steady)),
            "loss": [s["loss"] for s in stats], "grad_norm": [s["grad_norm"] for s in stats],
            "tokens": mb.num_tokens}


def _allocated() -> int:
    return 0 if DRY else torch.cuda.memory_allocated()


def offload_cycle(t) -> dict:
    before = {k: v.clone().cpu() for k, v in t.hf_state_dict().items()}
    opt_before = [v.clone().cpu() for v in t._optimizer_tensors()]
    mem0 = _allocated()
    off = t.offload()
    mem1 = _allocated()
    back = t.restore()
    mem2 = _allocated()
    identical = all(torch.equal(before[k], v.cpu()) for k, v in t.hf_state_dict().items()) and all(
        torch.equal(a, b.cpu()) for a, b in zip(opt_before, t._optimizer_tensors()))
    return {"offload": off, "restore": back, "gpu_bytes_before": mem0, "gpu_bytes_offloaded": mem1,
            "gpu_bytes_restored": mem2, "bit_identical": identical}


def tree_attention_timing(hf_config, hf_state, saved=lambda out, part: None) -> dict:
    """bench_ablation.py's tree-vs-expanded figures on the GPU, for both trainers.

    Case-study-shaped batch (bench_ablation's scaled shape and seeds, K=all), 4k-token rows,
    behaviour log-probs set to the model's own (on-policy, so the gradient does not vanish);
    forward+backward of the whole batch through the tree attention path (FlexAttention block
    masks) for both layouts, and through the dense [S,S] mask for reference; fastest of 3
    interleaved repetitions after a warm-up that compiles every shape. Goal:
    tree_time_over_expanded <= 1.1 x tree_tokens_over_expanded.
    `saved(out, part)` is called after each backend, so a timeout keeps the first one's figures
    (runs 2-3 on an H200 timed out with nothing written, compiling every row shape).
    """
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_ablation import MICRO_BATCH_TOKENS, SHORT_ROWS, executions, scaled_shape, set_on_policy

    from gyre.config import TrainConfig
    from gyre.train.toy import random_qwen2
    from gyre.train.trainer import EmbeddedTrainer
    from gyre.traj.materialize import materialize, prepare_step
    from gyre.traj.select import SelectionSpec

    dtype = "float32" if DRY else "bfloat16"
    records = executions(scaled_shape(), vocab=hf_config.vocab_size)
    budget = SHORT_ROWS if DRY else MICRO_BATCH_TOKENS  # the dry run: main-only, 1k-token rows
    out: dict = {"row_tokens": budget}
    batches: dict = {}
    for backend in ("embedded", "megatron"):
        if backend == "embedded":
            model = random_qwen2(hf_config, seed=0, std=0.02)
            model.load_state_dict(hf_state)
            t = EmbeddedTrainer(TrainConfig(dtype=dtype, off_policy="none"), model, device=DEV)
        else:
            t = trainer(dtype, hf_config, hf_state)
        if not batches:  # same weights in both trainers: one on-policy pass serves both
            set_on_policy(t, records)
            step = prepare_step(records, SelectionSpec(k="main" if DRY else "all"), step_version=0)
            mats = {lay: materialize(step.executions, layout=lay, micro_batch_tokens=budget)
                    for lay in ("tree", "expanded")}
            batches = {lay: list(m) for lay, m in mats.items()}
            out["tokens"] = {lay: m.stats.tokens for lay, m in mats.items()}
            out["tree_tokens_over_expanded"] = out["tokens"]["tree"] / out["tokens"]["expanded"]
        runs = [(lay, att) for lay in ("tree", "expanded") for att in ("tree", "dense")]
        times: dict = {r: [] for r in runs}
        norms: dict = {}
        for rep in range(1 + (1 if DRY else 3)):  # rep 0 compiles every shape: not timed
            for lay, att in runs:
                t.attention = att
                sync()
                t0 = time.perf_counter()
                for mb in batches[lay]:
                    t.forward_backward(mb)
                sync()
                if rep:
                    times[lay, att].append(time.perf_counter() - t0)
                else:
                    print(f"tree_attention {backend}: {lay} rows, {att} attention: first pass (compiles) "
                          f"{time.perf_counter() - t0:.1f} s", flush=True)
                norms[f"{lay}_{att}"] = float(t.flat_grads().norm())
                t.clear_gradients()
        best = {f"{lay}_{att}_fwd_bwd_s": min(v) for (lay, att), v in times.items()}
        ref = norms["expanded_dense"]
        out[backend] = {
            **best,
            "tree_time_over_expanded": best["tree_tree_fwd_bwd_s"] / best["expanded_tree_fwd_bwd_s"],
            "tree_time_over_expanded_dense_mask": best["tree_dense_fwd_bwd_s"] / best["expanded_dense_fwd_bwd_s"],
            "grad_norms": norms,
            "grad_norm_max_rel_diff": max(abs(n - ref) / ref for n in norms.values()),
        }
        out[backend]["goal_met"] = (out[backend]["tree_time_over_expanded"]
                                    <= 1.1 * out["tree_tokens_over_expanded"])
        saved(out, f"tree_attention_{backend}")
        del t
        if not DRY:
            torch.cuda.empty_cache()
    return out


def save(result: dict, part: str, **figures) -> None:
    """Write what is measured so far (after each part: a timeout later loses nothing before it)."""
    result.update(figures)
    result["done"] = f"{result['done']},{part}" if result.get("done") else part
    print(f"bench_train_gpu: {part} done", flush=True)
    if OUT is not None:
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(json.dumps(flat(result), indent=2))


def main() -> int:
    if PART not in ("all", "steps", "tree"):
        print(f"bench_train_gpu: --part {PART!r}: choose steps or tree (or leave it out for both)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available() and not DRY:
        print("bench_train_gpu: no CUDA device here; nothing measured (the CPU path is covered by "
              "the test suite)")
        return 0
    warnings.filterwarnings("ignore")
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 agreement check means exact fp32
    torch.backends.cudnn.allow_tf32 = False
    from gyre.train.toy import random_qwen2

    hf = random_qwen2(model_config(), seed=0, std=0.02)
    hf_state = {k: v.clone() for k, v in hf.state_dict().items()}
    n_params = sum(v.numel() for v in hf_state.values())
    mb = toy_batch(hf.config.vocab_size)
    result = {"device": "cpu (dry run)" if DRY else torch.cuda.get_device_name(), "torch": torch.__version__,
              "params": n_params, "batch": {"rows": ROWS, "seq": SEQ, "targets": mb.num_targets}, "done": ""}

    if PART == "tree":
        tree_attention_timing(hf.config, hf_state, lambda out, part: save(result, part, tree_attention=out))
        print(json.dumps(result, indent=2))
        return 0
    # the bf16 steps first: the figures the GPU run is for
    t = trainer("float32" if DRY else "bfloat16", hf.config, hf_state)
    result["agreement_bf16_initial"] = agreement(t, mb, torch.bfloat16)
    result["steps_bf16"] = run_steps(t, mb)
    save(result, "steps_bf16")
    result["agreement_bf16_trained"] = agreement(t, mb, torch.bfloat16)
    result["engine_agreement_bf16_trained"] = engine_agreement(t, hf.config.vocab_size)
    save(result, "agreement_bf16")
    result["offload_restore_bf16"] = offload_cycle(t)
    result["step_after_restore"] = run_steps(t, mb)["loss"][:1]
    save(result, "offload_restore_bf16")
    del t
    if not DRY:
        torch.cuda.empty_cache()

    t32 = trainer("float32", hf.config, hf_state)
    result["agreement_fp32"] = agreement(t32, mb, torch.float32)
    result["engine_agreement_fp32"] = engine_agreement(t32, hf.config.vocab_size)
    save(result, "agreement_fp32")
    del t32
    if not DRY:
        torch.cuda.empty_cache()

    if PART == "all":
        tree_attention_timing(hf.config, hf_state, lambda out, part: save(result, part, tree_attention=out))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
