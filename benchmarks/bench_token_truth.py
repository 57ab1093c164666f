"""Token truth (issue 29): does what trains equal what was sampled, under the sampling parameters?

    python benchmarks/bench_token_truth.py [--requests 16] [--max-tokens 32] [--lr 0.04]

Offline, on the embedded tiny model, through Gyre's own parts: the learnable suite's prompts
rendered by the proxy's code, sampled by the embedded engine (in process) with the parameters the
proxy sends, each call recorded into a trajectory tree with its sampling parameters
(``TrajectoryTree.add_call``), the step prepared and materialized (``prepare_step``,
``materialize``), and the embedded trainer (float32) computing the log-probs.

* ``mismatch_k3_lag0_t1`` / ``mismatch_k3_lag0_t07``: the k3 KL estimate between the engine's
  behaviour log-probs and the trainer's at the same weights (lag 0), samples at temperature 1
  and 0.7 (top_p 1). ``mismatch_k3_lag0_t07_top_p09``: temperature 0.7 with top_p 0.9 (the
  engine reports SGLang's unfiltered log-prob, so the trainer agrees there too).
  ``mismatch_k3_lag0_t07_trained_at_t1`` is the same T=0.7 samples trained at temperature 1, as
  ``gyre/services/training.py`` built every micro-batch before issue 29 (the BEFORE figure).
* ``clip_frac_minibatches_<n>`` (n = 1, 2, 4): the share of tokens the decoupled clip cut in one
  step of ``Trainer.train_step`` with ``train.minibatches_per_step = n`` (fresh trainer each, the
  T=1 samples, micro-batches of ``--mb-tokens``), mean over ``--steps`` steps.
* ``audit_mismatched_tokens``: the token-identity audit (``gyre.traj.audit``) over every
  micro-batch built above (goal 0), and ``audit_tokens`` audited.

Writes benchmarks/results/token_truth.json (flat). About five minutes on 2 shared cores.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import routing_replay, token_truth_templates  # noqa: E402
from benchmarks.learnability_check import SUITE, prompt_ids, sample_all  # noqa: E402
from gyre.config import default_tiny_dir, load_config, trainer_config  # noqa: E402
from gyre.engine.runtime import Engine  # noqa: E402
from gyre.engine.sampling import SamplingParams  # noqa: E402
from gyre.harness.tasks import load_suite  # noqa: E402
from gyre.model.tiny import ensure_tiny_model  # noqa: E402
from gyre.model.tokenizer import load_tokenizer  # noqa: E402
from gyre.proxy.capture import Renderer  # noqa: E402
from gyre.train.backends import make_trainer  # noqa: E402
from gyre.train.step_stats import merge, summarize  # noqa: E402
from gyre.traj.audit import Audit, audit_micro_batch  # noqa: E402
from gyre.traj.materialize import materialize, prepare_step  # noqa: E402
from gyre.traj.record import ExecutionRecord  # noqa: E402
from gyre.traj.select import SelectionSpec  # noqa: E402
from gyre.traj.tree import Segment, TrajectoryTree  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "token_truth.json"
# template_ids_equal_<name>: benchmarks/token_truth_templates.py (issue 29 item 1);
# routing_replay_mismatch_with / _without: benchmarks/routing_replay.py (item 5); both run by main()


def sampled_step(engine, renderer, prompts, n, sampling: dict, max_tokens: int, seed: int):
    """n executions of one call each (two groups), sampled and recorded as the proxy records them."""
    reqs = [(prompts[i % len(prompts)], SamplingParams(max_new_tokens=max_tokens, stop_token_ids=renderer.stop_ids(),
                                                        sampling_seed=seed * 1009 + i, **sampling))
            for i in range(n)]
    records = []
    for i, ((ids, _), f) in enumerate(zip(reqs, sample_all(engine, reqs))):
        tree = TrajectoryTree()
        tree.add_call([Segment("prompt", ids, "user")], f"out{i}", [], f.output_ids, f.logprobs,
                      agent_role="main", weight_version="0", policy_version=0, sampling=sampling)
        # rewards with variance inside each group, so every advantage is non-zero
        records.append(ExecutionRecord(f"e{i}", f"task{i % 2}", i % 2, reward=float(i % 3), tree=tree))
    return prepare_step(records, SelectionSpec(k=1), step_version=0, estimator="reward")


def micro_batches(batch, mb_tokens: int, audit: Audit) -> list:
    mat = materialize(batch.executions, layout="tree", micro_batch_tokens=mb_tokens)
    out = []
    for i in range(len(mat)):
        mb, keys = mat.with_keys(i)
        audit.add(audit_micro_batch(mb, keys, batch.executions))
        out.append(mb)
    return out


def lag0_k3(trainer, mbs, force_t1: bool = False) -> float:
    """k3 KL(engine || trainer) at lag 0 over the micro-batches (the trainer's own figure)."""
    from gyre.train.loss import mismatch_stats

    parts = []
    for mb in mbs:
        if force_t1:
            mb = type(mb)(**{**mb.__dict__, "temperature": torch.ones_like(mb.temperature)})
        parts.append({"targets": mb.num_targets, **mismatch_stats(trainer.logprobs(mb), mb.old_logprobs, mb.staleness)})
    return summarize(merge(parts, parallel=False))["mismatch_k3_lag0"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=16, help="executions per sampled step")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--mb-tokens", type=int, default=256, help="train.micro_batch_tokens (>= 4 micro-batches)")
    p.add_argument("--lr", type=float, default=4e-2, help="as learnability_check: the tiny model learns at this rate")
    p.add_argument("--steps", type=int, default=2, help="steps per minibatch setting")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    cfg = load_config(None, [f"train.lr={args.lr}", "train.backend=embedded", "train.dtype=float32",
                             "train.off_policy=decoupled"])
    model_dir = ensure_tiny_model(default_tiny_dir(cfg))
    renderer = Renderer(load_tokenizer(model_dir))
    prompts = [prompt_ids(renderer, t.prompt) for t in load_suite(SUITE)]
    out: dict = {"host": socket.gethostname(), "requests": args.requests, "max_tokens": args.max_tokens,
                 "mb_tokens": args.mb_tokens, "lr": args.lr, "steps": args.steps}
    audit = Audit()
    engine = Engine(model_dir, weight_version="0")
    try:
        steps = {name: sampled_step(engine, renderer, prompts, args.requests, sp, args.max_tokens, seed)
                 for seed, (name, sp) in enumerate([("t1", {"temperature": 1.0}), ("t07", {"temperature": 0.7}),
                                                    ("t07_top_p09", {"temperature": 0.7, "top_p": 0.9})])}
        more = [sampled_step(engine, renderer, prompts, args.requests, {"temperature": 1.0}, args.max_tokens, 10 + s)
                for s in range(args.steps - 1)]
    finally:
        engine.close()
    trainer = make_trainer(trainer_config(cfg), model_dir, seed=0)
    mbs = {name: micro_batches(b, args.mb_tokens, audit) for name, b in steps.items()}
    for name, m in mbs.items():
        out[f"mismatch_k3_lag0_{name}"] = lag0_k3(trainer, m)
    out["mismatch_k3_lag0_t07_trained_at_t1"] = lag0_k3(trainer, mbs["t07"], force_t1=True)
    out["micro_batches_per_step"] = len(mbs["t1"])

    step_mbs = [mbs["t1"]] + [micro_batches(b, args.mb_tokens, audit) for b in more]
    for n in (1, 2, 4):
        t = make_trainer(trainer_config(cfg), model_dir, seed=0)
        per_step = [t.train_step(m, n) for m in step_mbs]
        out[f"clip_frac_minibatches_{n}"] = statistics.fmean(s["clip_frac"] for s in per_step)
        out[f"clip_frac_minibatches_{n}_per_step"] = [s["clip_frac"] for s in per_step]
        out[f"prox_drift_max_minibatches_{n}"] = max(s["prox_drift_max"] for s in per_step)
    out["audit_mismatched_tokens"] = audit.mismatched
    out["audit_tokens"] = audit.tokens
    out.update(token_truth_templates.measure())  # real templates through the proxy, ids vs transformers
    out.update(routing_replay.measure())         # the tiny MoE with and without routing replay
    out["wall_s"] = time.perf_counter() - t_start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in out.items() if not isinstance(v, list)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
