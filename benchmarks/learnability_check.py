"""Is the learnable suite learnable? Online GRPO on the embedded tiny model, offline, no HTTP.

    python benchmarks/learnability_check.py [--lr 0.04] [--groups 2] [--group-size 16] [--steps 10] [--seeds 8]

The loop is Gyre's, minus the processes and sockets:

* prompts: each task's ``start.md`` as :mod:`gyre.harness.answer_agent` sends it
  (``first_messages``), rendered to ids by the proxy's own code (``prepare_call``);
* sampling: the embedded engine itself (:class:`gyre.engine.runtime.Engine`, in process) with the
  parameters the proxy sends (``max_new_tokens``, temperature 1.0, top_p 1.0, the renderer's stop
  ids), so the sampling rule and the behaviour log-probs are the engine's;
* answers: the output ids decoded and parsed as the proxy does (``parse_output``): the text the
  harness would write to ``answer.txt``;
* reward: :func:`gyre.harness.builtin_learnable.scoring.reward`, the function the suite's pytest
  tests call (they ship a byte-identical copy), i.e. passed / test_case_count;
* training: ``make_trainer(cfg.train, model_dir)`` (the embedded trainer), GRPO advantages from
  :mod:`gyre.advantage`, one expanded :class:`MicroBatch` per step (prompt + answer rows,
  the answer tokens as targets, the engine's log-probs as ``old_logprobs``, each execution's
  tokens averaged) through :func:`gyre.train.loss.policy_loss`; then the weights are exported and
  the engine loads them (``update_weights_from_disk``), as the rollout cells do.

Step k's reward is measured on the samples drawn for step k (policy version k); one more batch is
drawn after the last update. Prints one line per step and, with ``--json``, writes the curve.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from gyre.advantage import advantages
from gyre.batch import expanded_batch
from gyre.config import default_tiny_dir, load_config
from gyre.engine.runtime import Engine, Finished
from gyre.engine.sampling import SamplingParams
from gyre.harness.answer_agent import first_messages
from gyre.harness.builtin_learnable import scoring
from gyre.harness.tasks import load_suite
from gyre.model.tiny import ensure_tiny_model
from gyre.model.tokenizer import load_tokenizer
from gyre.proxy.capture import ExecutionSession, Renderer, prepare_call
from gyre.proxy.chat import parse_messages, parse_output
from gyre.train.backends import make_trainer
from gyre.traj.record import ExecutionRecord

SUITE = Path(scoring.__file__).resolve().parent


def prompt_ids(renderer: Renderer, text: str) -> list[int]:
    """The ids the proxy sends to the engine for a fresh execution's first call."""
    session = ExecutionSession(ExecutionRecord("learnability", "task", 0), "key")
    return prepare_call(renderer, session, parse_messages(first_messages(text)), []).input_ids


def sample_all(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[Finished]:
    out: list[Finished | None] = [None] * len(requests)
    left = [len(requests)]
    done = threading.Event()
    lock = threading.Lock()

    def on_done(i):
        def cb(f: Finished):
            out[i] = f
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()
        return cb

    for i, (ids, params) in enumerate(requests):
        engine.submit(f"lc-{i}", ids, params, on_done(i))
    if not done.wait(600):
        raise TimeoutError("the engine did not finish the batch in 600 s")
    bad = [f.finish_reason for f in out if f.finish_reason.get("type") == "abort"]
    if bad:
        raise RuntimeError(f"engine aborted requests: {bad[:3]}")
    return out  # type: ignore[return-value]


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    cfg = load_config(args.config, [f"train.lr={args.lr}", "train.backend=embedded",
                                    "train.dtype=float32", *args.set])
    model_dir = ensure_tiny_model(args.model_dir or default_tiny_dir(cfg))
    tasks = load_suite(args.suite)
    if args.tasks:
        tasks = [t for t in tasks if t.name in args.tasks]
    renderer = Renderer(load_tokenizer(model_dir))
    prompts = {t.name: prompt_ids(renderer, t.prompt) for t in tasks}
    params = dict(max_new_tokens=args.max_tokens, temperature=args.temperature, top_p=1.0,
                  stop_token_ids=renderer.stop_ids())

    engine = Engine(model_dir, weight_version="0")
    trainer = make_trainer(cfg.train, model_dir, seed=args.seed)
    curve, t_start = [], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gyre-learnability-") as tmp:
        try:
            for step in range(args.steps + 1):
                t0 = time.perf_counter()
                groups = [tasks[(step * args.groups + q) % len(tasks)] for q in range(args.groups)]
                reqs = []
                for q, task in enumerate(groups):
                    for g in range(args.group_size):
                        seed = (args.seed * 1_000_003 + step * 10_007 + q * 101 + g) & 0x7FFFFFFF
                        reqs.append((prompts[task.name], SamplingParams(**params, sampling_seed=seed)))
                outs = sample_all(engine, reqs)
                texts = [parse_output(renderer.decode(f.output_ids)).content or "" for f in outs]
                names = [groups[i // args.group_size].name for i in range(len(outs))]
                rewards = [scoring.reward(n, t) for n, t in zip(names, texts)]
                row = {"step": step, "reward": statistics.fmean(rewards),
                       "reward_by_task": {t.name: statistics.fmean(r for n, r in zip(names, rewards) if n == t.name)
                                          for t in tasks if t.name in names},
                       "answer_tokens": statistics.fmean(len(f.output_ids) for f in outs),
                       "answer_chars": statistics.fmean(map(len, texts)),
                       "groups_with_signal": sum(len(set(rewards[q * args.group_size:(q + 1) * args.group_size])) > 1
                                                 for q in range(args.groups)),
                       "example": texts[0][:60]}
                t_sample = time.perf_counter() - t0
                if step < args.steps:
                    group_ids = torch.tensor([i // args.group_size for i in range(len(outs))])
                    adv = advantages(torch.tensor(rewards), group_ids, cfg.train.advantage).tolist()
                    seqs = [reqs[i][0] + list(f.output_ids) for i, f in enumerate(outs)]
                    mb = expanded_batch(seqs, [len(r[0]) for r in reqs],
                                        old_logprobs=[list(f.logprobs) for f in outs], advantages=adv,
                                        execution_index=list(range(len(outs))),
                                        temperature=args.temperature)
                    trainer.forward_backward(mb)
                    stats = trainer.optimizer_step()
                    out_dir = trainer.export_weights(Path(tmp) / "weights", step + 1)
                    engine.update_weights_from_disk(str(out_dir), str(step + 1))
                    row.update(ratio_mean=stats["ratio_mean"], kl_old=stats["kl_old"],
                               grad_norm=stats["grad_norm"], loss=stats["loss"])
                row.update(sample_s=t_sample, step_s=time.perf_counter() - t0)
                curve.append(row)
                if not args.quiet:
                    extra = (f"  ratio {row['ratio_mean']:.4f}  kl_old {row['kl_old']:.2e}  "
                             f"grad_norm {row['grad_norm']:.3f}") if "loss" in row else ""
                    print(f"step {step:2d}  reward {row['reward']:.3f}  "
                          + " ".join(f"{k}={v:.2f}" for k, v in row["reward_by_task"].items())
                          + f"  tokens {row['answer_tokens']:.1f}  chars {row['answer_chars']:.0f}  "
                          f"signal {row['groups_with_signal']}/{args.groups}{extra}  "
                          f"{row['step_s']:.1f}s  e.g. {row['example']!r}", flush=True)
        finally:
            engine.close()
    return {"lr": args.lr, "groups": args.groups, "group_size": args.group_size, "steps": args.steps,
            "max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed,
            "tasks": [t.name for t in tasks], "threads": args.threads,
            "wall_s": time.perf_counter() - t_start, "curve": curve}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lr", type=float, default=4e-2)
    p.add_argument("--groups", "-Q", type=int, default=2, help="groups per step (tasks taken in turn)")
    p.add_argument("--group-size", "-G", type=int, default=16, help="executions per group")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps")
    p.add_argument("--max-tokens", type=int, default=24, help="as answer_agent --max-tokens")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, default=1, help="repeat with seeds seed..seed+N-1; print mean and min")
    p.add_argument("--suite", default=str(SUITE))
    p.add_argument("--tasks", nargs="*", default=None, help="only these tasks of the suite")
    p.add_argument("--model-dir", default=None, help="default: model.tiny_dir (built if missing)")
    p.add_argument("--config", default=None, help="Gyre TOML config ([train] section used)")
    p.add_argument("--set", action="append", default=[], help="config override section.key=value")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--json", default=None, help="write the curve(s) here")
    p.add_argument("--quiet", action="store_true", help="no per-step lines")
    args = p.parse_args(argv)
    results = []
    for seed in range(args.seed, args.seed + args.seeds):
        args.seed = seed
        results.append(run(args))
        c = results[-1]["curve"]
        print(f"seed {seed}: reward " + " ".join(f"{r['reward']:.2f}" for r in c)
              + f"  ({results[-1]['wall_s']:.1f}s)", flush=True)
    curves = [[r["reward"] for r in res["curve"]] for res in results]
    mean = [statistics.fmean(col) for col in zip(*curves)]
    print(f"lr {args.lr:g}  Q {args.groups}  G {args.group_size}  {len(results)} seed(s)")
    print("step  " + " ".join(f"{i:4d}" for i in range(len(mean))))
    print("mean  " + " ".join(f"{x:4.2f}" for x in mean))
    if len(results) > 1:
        print("min   " + " ".join(f"{min(col):4.2f}" for col in zip(*curves)))
    print(f"reward {mean[0]:.3f} -> {mean[-1]:.3f} in {args.steps} steps; "
          f"{statistics.fmean(r['wall_s'] for r in results):.1f}s per run")
    if args.json:
        Path(args.json).write_text(json.dumps(results if len(results) > 1 else results[0], indent=1) + "\n",
                                   encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
