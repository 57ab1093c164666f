"""Hybrid Gated DeltaNet families on the CPU (issue 30): Gyre's forwards against transformers, and
tree training with the recurrent state forked at branch points against the expanded layout.

Per family (qwen3_next, qwen3_5, qwen3_5_moe; tiny random models: 3 Gated DeltaNet layers + 1
gated full-attention layer, built offline):
  * ``<family>_logits_max_abs_diff``: embedded trainer module vs transformers (eager, torch fallback
    of the gated delta rule), two causal rows of 70 tokens (two 64-token chunks);
  * ``<family>_grad_max_abs_diff``: trainer gradients vs transformers' (relative to the largest);
  * ``<family>_engine_logprob_diff``: the engine's prefill (70 tokens) + 10 decode steps vs
    transformers' log-probs, from a directory written by save_pretrained.
Then ``prefix_state_resume_max_abs_diff``: the engine resumes a request from a cached prefix's
stored state (exact end and a partial share recomputing from the deepest state) vs transformers.
Tree vs expanded on the paper's case-study shape (`gyre.traj.synthetic.CASE_STUDY`: 636 calls,
10 candidate trajectories, sub-agents, compactions, retries, parallel tool calls) with message
lengths scaled by ``LENGTH_SCALE`` so a CPU trains it, tiny Qwen3.5-MoE, float32:
``tree_vs_expanded_grad_max_abs_diff`` (relative), ``tree_tokens_over_unique`` (tokens the linear
layers scanned / the tree's unique tokens), ``tree_time_over_expanded`` (forward + backward of
every micro-batch), with the token counts and seconds.
Writes benchmarks/results/hybrid.json. A few minutes on 2 cores.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from gyre.config import TrainConfig  # noqa: E402
from gyre.engine.hybrid import causal_lm  # noqa: E402
from gyre.engine.prefix_cache import PrefixCache  # noqa: E402
from gyre.model.spec import load_weights, read_spec  # noqa: E402
from gyre.train.gated_deltanet import TreeScan  # noqa: E402
from gyre.train.hybrid import HybridLM  # noqa: E402
from gyre.train.toy import random_model, tiny_config  # noqa: E402
from gyre.train.trainer import EmbeddedTrainer  # noqa: E402
from gyre.traj.materialize import materialize, prepare_step  # noqa: E402
from gyre.traj.record import ExecutionRecord  # noqa: E402
from gyre.traj.select import SelectionSpec  # noqa: E402
from gyre.traj.synthetic import CASE_STUDY, Lengths, generate  # noqa: E402
from parity import engine_decode_diff, logits_and_grads  # noqa: E402

FAMILIES = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]
VOCAB = 96
LENGTH_SCALE = 0.03  # case-study message lengths x 0.03: the same tree, ~17K unique tokens (this branch
# still builds the dense S x S mask per micro-batch, so larger rows do not fit 6 GB)


def family_figures(family: str) -> dict:
    hf = random_model(tiny_config(family), seed=4, std=0.2)
    ours = HybridLM.from_transformers(hf)
    ids = torch.randint(0, VOCAB, (2, 70), generator=torch.Generator().manual_seed(0))
    out = logits_and_grads(hf(input_ids=ids).logits, ours(ids), hf, ours)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        spec = read_spec(d)
        engine = causal_lm(spec, load_weights(d, spec))
    seq = torch.randint(0, VOCAB, (1, 80), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref_lp = torch.log_softmax(hf(input_ids=seq).logits[0], -1)
    cache = engine.new_cache()
    out["engine_logprob_diff"] = engine_decode_diff(engine, cache, seq[0, :78].tolist(), ref_lp, 70)
    # prefix cache holding 78 tokens: a request extending them resumes at 78; one sharing only 75
    # resumes from the deepest stored state (the prompt's end, 70) and recomputes 70..74
    prefix = PrefixCache()
    prefix.insert(seq[0, :78].tolist(), cache)
    resume = []
    for prompt, upto in ((seq[0, :80].tolist(), 80), (seq[0, :75].tolist() + [1, 2], 75)):
        c, n = prefix.lookup(prompt)
        lp = torch.log_softmax(engine.forward(seq[0, n:upto].tolist(), c), -1)
        resume.append(float((lp - ref_lp[upto - 1]).abs().max()))
    out["prefix_state_resume_max_abs_diff"] = max(resume)
    return out


def _scaled(lengths: Lengths) -> Lengths:
    return dataclasses.replace(lengths, median=max(2.0, lengths.median * LENGTH_SCALE),
                               hi=max(8, round(lengths.hi * LENGTH_SCALE)))


def tree_figures() -> dict:
    shape = dataclasses.replace(CASE_STUDY, **{f: _scaled(getattr(CASE_STUDY, f))
                                               for f in ("system", "task", "assistant", "tool", "summary")})
    tree = generate(shape).tree
    for n in tree.nodes:  # the tiny model's vocabulary; the tree keeps its structure
        n.tokens = (n.tokens % (VOCAB - 1) + 1).astype(np.int32)
    rec = ExecutionRecord("case", "t", 0, "done", 1.0, "tests", tree=tree)
    other = ExecutionRecord("zero", "t", 0, "done", 0.0, "tests", tree=tree)  # a group of 2: advantages != 0
    step = prepare_step([rec, other], SelectionSpec(k="all"), step_version=0)
    stats = tree.stats()
    hf = random_model(tiny_config("qwen3_5_moe", vocab_size=VOCAB), seed=1, std=0.2)
    out, grads = {}, {}
    for layout in ("tree", "expanded"):
        mbs = list(materialize(step.executions[:1], layout=layout, micro_batch_tokens=1 << 17))
        trainer = EmbeddedTrainer(TrainConfig(dtype="float32", clip=False, moe_aux_loss_coef=0.0), hf,
                                  device="cpu", attention="tree")
        t0 = time.perf_counter()
        for mb in mbs:
            trainer.forward_backward(mb)
        out[f"{layout}_s"] = time.perf_counter() - t0
        grads[layout] = trainer.flat_grads()
        out[f"{layout}_scanned_tokens"] = sum(TreeScan.build(mb.kv_end).tokens for mb in mbs)
        out[f"{layout}_micro_batches"] = len(mbs)
    ref = grads["expanded"]
    out["tree_vs_expanded_grad_max_abs_diff"] = float((grads["tree"] - ref).abs().max() / ref.abs().max())
    out["tree_tokens_over_unique"] = out["tree_scanned_tokens"] / stats.unique_tokens
    out["expanded_tokens_over_unique"] = out["expanded_scanned_tokens"] / stats.unique_tokens
    out["tree_time_over_expanded"] = out["tree_s"] / out["expanded_s"]
    out.update(case_calls=stats.calls, case_leaves=stats.leaves, case_unique_tokens=stats.unique_tokens,
               case_expanded_tokens=stats.expanded_tokens, length_scale=LENGTH_SCALE)
    return out


def main() -> dict:
    # many small ops: on this loaded 2-core machine a second torch thread made them ~10x slower
    torch.set_num_threads(1)
    out: dict = {}
    resume = []
    for family in FAMILIES:
        figs = family_figures(family)
        resume.append(figs.pop("prefix_state_resume_max_abs_diff"))
        out |= {f"{family}_{k}": v for k, v in figs.items()}
    out["prefix_state_resume_max_abs_diff"] = max(resume)
    out |= tree_figures()
    out = {k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in out.items()}
    dest = ROOT / "benchmarks" / "results" / "hybrid.json"
    dest.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
