"""The paper's selection ablation on case-study-shaped executions: main-only vs K=5 vs K=all, in
the expanded and the tree-packed layouts, all on the same batch, at the same weights, in one run.

Batch: four executions of the case-study shape (gyre.traj.synthetic.CASE_STUDY: 10 candidate
trajectories = 3 compactor branches, the final main branch, 3 sub-agent runs, 3 abandoned
retries) with different seeds and rewards, in one GRPO group.

Scaled down so that the whole grid runs in about 2 minutes on 2 CPU cores (the constants below;
recorded in the JSON as ``scale``): the full case study is 566k unique tokens per execution. Calls go from 636 to 40 (main 510 -> 25, each sub-agent run
40 -> 3 calls; compactions, sub-agents and retries stay 3 each, so the 10 leaves and their roles
are the paper's), assistant and tool messages are 16x shorter, and the once-per-conversation
messages (system, task, summary) 256x shorter, so that with 16x fewer calls per conversation
they keep their share of a path. Each execution is then 2.4-3k unique tokens and fits one
micro-batch, which is what makes tree-packed compute exactly the unique tokens. The token
columns of the *unscaled* case study (same seeds) are recorded too (``full_*``): they need no
training, only materialization.

Model: a random Qwen2 (gyre.train.toy) with the embedded tiny model's shape (hidden 64, 2 layers,
4 heads, 2 KV heads) and a 2048-token vocabulary; synthetic ids (Qwen's) are taken modulo 2048.
Behaviour log-probs are replaced by the model's own (one no-grad pass over every target), so the
batch is on-policy (importance ratio 1, as right after a synchronous rollout): with the synthetic
log-probs most ratios would be clipped and the gradient would mostly vanish.

Attention: the trainer's tree path (gyre.train.tree_attention: block-sparse, work follows each
row's ancestor pairs, for tree and expanded rows alike). The K=all batch is also run through the
dense [S, S] mask (``all_tree_dense``, ``all_expanded_dense``: what the trainer did before), where
a tree-packed row costs O(S^2) over the whole execution.
Headline: ``tree_tokens_over_expanded`` and ``tree_time_over_expanded`` (K=all, 4k-token rows,
forward+backward, both layouts through the tree path, same run); goal: time ratio <= 1.1 x token
ratio (``tree_time_goal``). Per selection: ``{sel}_tree_time_over_expanded``.

Per (selection, layout): tokens_computed (tokens the forward pass computes, padding excluded),
fwd_bwd_s (forward + backward of every micro-batch of the batch, in CPU seconds of the process
with one torch thread, i.e. the wall time on an idle core; the smallest of --reps interleaved
repetitions; building the micro-batch tensors is excluded, the trainer's own mask conversion is
included; CPU time rather than wall time because the 2 cores here are shared and wall times under
load are recorded too, as fwd_bwd_wall_s, with the load average), grad_norm (L2 norm of the
batch's accumulated gradient, before clipping, no optimizer step: every configuration sees the
same weights; tree and expanded must agree). Extra ``*_tree_mb1024`` rows: tree-packed with
micro-batches of 1024 tokens (just above the longest trajectory), where an execution is cut
along its leaf paths and shared prefixes repeat, but no row is longer than 1024 tokens: the
dense path's attention costs O(S^2) per row whatever the tree.
Writes benchmarks/results/ablation.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from gyre.config import TrainConfig  # noqa: E402
from gyre.train import tree_attention  # noqa: E402
from gyre.train.toy import random_qwen2, tiny_qwen2_config  # noqa: E402
from gyre.train.trainer import EmbeddedTrainer  # noqa: E402
from gyre.traj.materialize import materialize, prepare_step  # noqa: E402
from gyre.traj.select import SelectionSpec  # noqa: E402
from gyre.traj.synthetic import CASE_STUDY, Shape, generate  # noqa: E402

PAPER = {"paper_k5_time_saving": 0.252}  # K=5 vs all: 25.2% less forward-backward time
SELECTIONS = {"main_only": "main", "k5": 5, "all": "all"}
LAYOUTS = ("tree", "expanded")
REWARDS = (1.0, 0.0, 0.6, 0.2)  # one GRPO group: distinct rewards, nonzero advantages
VOCAB = 2048
MICRO_BATCH_TOKENS = 4096  # every execution's selected union fits: tree computes unique tokens
SHORT_ROWS = 1024  # >= the longest trajectory: tree rows split along leaf paths, prefixes repeated
CALLS, SUBAGENT_CALLS = 40, 3  # 636 -> 40 calls (main 510 -> 25, sub-agent runs 40 -> 3 calls)
CALLS_DIV = 16      # about 636 / 40
LENGTH_DIV = 16     # assistant and tool messages
ONCE_DIV = 16 * 16  # system, task and summary: LENGTH_DIV x CALLS_DIV


def scaled_shape() -> Shape:
    s = CASE_STUDY

    def div(lengths, d):
        return replace(lengths, median=max(1.0, lengths.median / d))

    return replace(s, calls=CALLS, subagent_calls=SUBAGENT_CALLS,
                   versions_every=max(1, s.versions_every // CALLS_DIV),
                   assistant=div(s.assistant, LENGTH_DIV), tool=div(s.tool, LENGTH_DIV),
                   system=div(s.system, ONCE_DIV), task=div(s.task, ONCE_DIV),
                   summary=div(s.summary, ONCE_DIV))


def executions(shape: Shape, vocab: int | None = VOCAB) -> list:
    out = []
    for k, reward in enumerate(REWARDS):
        r = generate(replace(shape, seed=k), execution_id=f"case-e{k}", task="case-study", group=0)
        r.reward, r.passed, r.total = reward, round(reward * 10), 10
        if vocab is not None:
            for n in r.tree.nodes:
                n.tokens = (n.tokens % vocab).astype(np.int32)
        out.append(r)
    return out


def make_trainer(seed: int = 0) -> EmbeddedTrainer:
    cfg = tiny_qwen2_config(vocab_size=VOCAB)  # hidden 64, 2 layers, 4 heads, 2 KV heads
    cfg.max_position_embeddings = 32768
    # off_policy none: the loss ablation.json was recorded with (the selection and packing are what
    # this measures; tis/decoupled add a no-grad forward and reweight by the synthetic log-probs)
    return EmbeddedTrainer(TrainConfig(dtype="float32", grad_clip=0.0, off_policy="none"),
                           random_qwen2(cfg, seed=seed, std=0.1), device="cpu")


def set_on_policy(trainer: EmbeddedTrainer, records: list) -> int:
    """Overwrite every target's behaviour log-prob with the current model's; returns targets."""
    batch = prepare_step(records, SelectionSpec(k="all"), step_version=0)
    mats = materialize(batch.executions, layout="tree", micro_batch_tokens=MICRO_BATCH_TOKENS)
    n = 0
    for i in range(len(mats)):
        mb, keys = mats.with_keys(i)
        lp = trainer.logprobs(mb).numpy()
        for (e, node, off), v in zip(keys.tolist(), lp.tolist()):
            nd = batch.executions[e].record.tree.nodes[node]
            nd.logprobs[off - nd.target_start] = v
        n += len(lp)
    return n


def token_columns(records: list, budget: int) -> dict:
    out = {}
    for label, k in SELECTIONS.items():
        batch = prepare_step(records, SelectionSpec(k=k), step_version=0)
        for layout in LAYOUTS:
            st = materialize(batch.executions, layout=layout, micro_batch_tokens=budget).stats
            out[f"{label}_{layout}"] = st
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions; the fastest counts")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1: CPU time of the process is the trainer's time)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "ablation.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    shape = scaled_shape()
    records = executions(shape)
    trainer = make_trainer()
    n_targets = set_on_policy(trainer, records)

    # micro-batches built once per configuration; timing covers the trainer only
    configs = {}
    attention = {}  # config name -> the trainer's attention path
    for label, k in SELECTIONS.items():
        batch = prepare_step(records, SelectionSpec(k=k), step_version=0)
        for layout, budget in [(lay, MICRO_BATCH_TOKENS) for lay in LAYOUTS] + [("tree", SHORT_ROWS)]:
            mats = materialize(batch.executions, layout=layout, micro_batch_tokens=budget)
            name = f"{label}_{layout}" + ("" if budget == MICRO_BATCH_TOKENS else f"_mb{budget}")
            configs[name], attention[name] = (mats.stats, list(mats)), "tree"
            if label == "all" and budget == MICRO_BATCH_TOKENS:  # the same batch, dense S x S
                configs[f"{name}_dense"], attention[f"{name}_dense"] = configs[name], "dense"
    warm = min((mbs[0] for _, mbs in configs.values()), key=lambda mb: mb.input_ids.numel())
    trainer.forward_backward(warm)
    trainer.clear_gradients()

    load_before = os.getloadavg()
    wall = {name: [] for name in configs}
    cpu = {name: [] for name in configs}
    norms = {}
    names = list(configs)
    for rep in range(args.reps):  # interleaved, in a rotated order each time: drift hits all alike
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            mbs = configs[name][1]
            trainer.attention = attention[name]
            fb, c0 = 0.0, time.process_time()
            for mb in mbs:
                fb += trainer.forward_backward(mb)["fwd_bwd_s"]
            cpu[name].append(time.process_time() - c0)
            norms[name] = float(trainer.flat_grads().norm())
            trainer.clear_gradients()
            wall[name].append(fb)

    out: dict = {}
    for name, (stats, _) in configs.items():
        out[f"{name}_tokens_computed"] = stats.tokens
        out[f"{name}_fwd_bwd_s"] = min(cpu[name])
        out[f"{name}_grad_norm"] = norms[name]
    for name, (stats, _) in configs.items():
        out[f"{name}_fwd_bwd_wall_s"] = min(wall[name])
        out[f"{name}_fwd_bwd_s_all_reps"] = [round(x, 4) for x in cpu[name]]
        out[f"{name}_micro_batches"] = stats.micro_batches
        out[f"{name}_rows"] = stats.rows
        out[f"{name}_padded_tokens"] = stats.padded_tokens
    for label in SELECTIONS:
        st = configs[f"{label}_tree"][0]
        out[f"{label}_unique_tokens"] = st.unique_tokens
        out[f"{label}_target_tokens"] = st.target_tokens
        out[f"{label}_trajectories"] = st.trajectories
        out[f"{label}_tree_tokens_over_unique"] = st.tokens / st.unique_tokens
        out[f"{label}_tree_mb{SHORT_ROWS}_tokens_over_unique"] = (
            configs[f"{label}_tree_mb{SHORT_ROWS}"][0].tokens / st.unique_tokens)
        out[f"{label}_expanded_tokens_over_unique"] = configs[f"{label}_expanded"][0].tokens / st.unique_tokens
    tree_tokens = sum(configs[f"{s}_tree"][0].tokens for s in SELECTIONS)
    unique = sum(configs[f"{s}_tree"][0].unique_tokens for s in SELECTIONS)
    out["tree_tokens_over_unique"] = tree_tokens / unique
    out["k5_over_all_time"] = out["k5_tree_fwd_bwd_s"] / out["all_tree_fwd_bwd_s"]
    out["k5_time_saving"] = 1.0 - out["k5_over_all_time"]
    out["k5_over_all_wall_time"] = out["k5_tree_fwd_bwd_wall_s"] / out["all_tree_fwd_bwd_wall_s"]
    out["k5_over_all_time_expanded"] = out["k5_expanded_fwd_bwd_s"] / out["all_expanded_fwd_bwd_s"]
    out[f"k5_over_all_time_tree_mb{SHORT_ROWS}"] = (out[f"k5_tree_mb{SHORT_ROWS}_fwd_bwd_s"]
                                                   / out[f"all_tree_mb{SHORT_ROWS}_fwd_bwd_s"])
    out["k5_over_all_tokens"] = out["k5_tree_tokens_computed"] / out["all_tree_tokens_computed"]
    out["tree_over_expanded_time_all"] = out["all_tree_fwd_bwd_s"] / out["all_expanded_fwd_bwd_s"]
    out[f"tree_mb{SHORT_ROWS}_over_expanded_time_all"] = (out[f"all_tree_mb{SHORT_ROWS}_fwd_bwd_s"]
                                                         / out["all_expanded_fwd_bwd_s"])
    out["main_only_over_k5_grad_norm"] = out["main_only_tree_grad_norm"] / out["k5_tree_grad_norm"]
    out["main_only_over_all_grad_norm"] = out["main_only_tree_grad_norm"] / out["all_tree_grad_norm"]
    out["grad_norm_tree_vs_expanded_max_rel_diff"] = max(
        abs(norms[f"{s}_tree"] - norms[f"{s}_expanded"]) / norms[f"{s}_expanded"] for s in SELECTIONS)
    out["grad_norm_tree_path_vs_dense_max_rel_diff"] = max(
        abs(norms[f"all_{lay}"] - norms[f"all_{lay}_dense"]) / norms[f"all_{lay}_dense"] for lay in LAYOUTS)
    # the tree path's headline: tree vs expanded, same batch, same run, both through the tree path
    for label in SELECTIONS:
        out[f"{label}_tree_time_over_expanded"] = (out[f"{label}_tree_fwd_bwd_s"]
                                                   / out[f"{label}_expanded_fwd_bwd_s"])
        out[f"{label}_tree_tokens_over_expanded"] = (out[f"{label}_tree_tokens_computed"]
                                                     / out[f"{label}_expanded_tokens_computed"])
    out["tree_tokens_over_expanded"] = out["all_tree_tokens_over_expanded"]
    out["tree_time_over_expanded"] = out["all_tree_time_over_expanded"]
    out["tree_time_goal"] = 1.1 * out["tree_tokens_over_expanded"]
    out["tree_time_goal_met"] = out["tree_time_over_expanded"] <= out["tree_time_goal"]
    out["tree_time_over_expanded_dense_mask"] = (out["all_tree_dense_fwd_bwd_s"]
                                                 / out["all_expanded_dense_fwd_bwd_s"])
    out["tree_path_speedup_tree_layout"] = out["all_tree_dense_fwd_bwd_s"] / out["all_tree_fwd_bwd_s"]
    out["tree_path_speedup_expanded_layout"] = (out["all_expanded_dense_fwd_bwd_s"]
                                                / out["all_expanded_fwd_bwd_s"])
    out["tree_attention_block"] = tree_attention.DEFAULT_BLOCK
    out.update(PAPER)

    # the unscaled case study (same seeds): tokens only, one micro-batch per execution
    full = token_columns(executions(CASE_STUDY, vocab=None), budget=1 << 22)
    for name, st in full.items():
        out[f"full_{name}_tokens_computed"] = st.tokens
    out["full_unique_tokens_all"] = full["all_tree"].unique_tokens
    out["full_k5_over_all_tokens"] = full["k5_tree"].tokens / full["all_tree"].tokens
    out["full_expanded_over_tree_tokens_all"] = full["all_expanded"].tokens / full["all_tree"].tokens

    stats = [r.tree.stats() for r in records]
    out.update({
        "executions": len(records), "rewards": list(REWARDS), "group_size": len(records),
        "leaves_per_execution": stats[0].leaves, "calls_per_execution": stats[0].calls,
        "unique_nodes_per_execution": [s.unique_nodes for s in stats],
        "unique_tokens_per_execution": [s.unique_tokens for s in stats],
        "on_policy_targets": n_targets, "micro_batch_tokens": MICRO_BATCH_TOKENS,
        "scale": (f"CASE_STUDY with calls 636->{shape.calls} (main {CASE_STUDY.main_calls}->"
                  f"{shape.main_calls}, sub-agent runs {CASE_STUDY.subagent_calls}->{shape.subagent_calls} "
                  f"calls; 3 compactions, 3 sub-agents, 3 retries kept: 10 leaves), assistant/tool "
                  f"lengths /{LENGTH_DIV}, system/task/summary lengths /{ONCE_DIV}; token ids mod {VOCAB}"),
        "model": "random Qwen2 (gyre.train.toy): hidden 64, 2 layers, 4 heads, 2 KV heads, "
                 f"vocab {VOCAB}, float32, embedded trainer, tree attention path "
                 "(block-sparse SDPA) unless *_dense (eager, dense [S,S] mask)",
        "reps": args.reps, "threads": args.threads, "load_average_1m_before": load_before[0],
        "load_average_1m_after": os.getloadavg()[0], "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__, "wall_s": time.perf_counter() - t_start,
    })
    out = {k: (float(f"{v:.6g}") if isinstance(v, float) else v) for k, v in out.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    res = main()
    keys = [f"{s}_{l}_{m}" for s in SELECTIONS for l in LAYOUTS
            for m in ("tokens_computed", "fwd_bwd_s", "grad_norm")]
    keys += ["k5_over_all_time", "tree_tokens_over_unique", "k5_over_all_tokens",
             "tree_tokens_over_expanded", "tree_time_over_expanded", "tree_time_goal",
             "tree_time_over_expanded_dense_mask", "wall_s"]
    print(json.dumps({k: res[k] for k in keys}, indent=2))
