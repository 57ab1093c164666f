"""Token truth against a running engine, for the real-engine tests and benchmarks/bench_real_engine.py:
sample through the engine's own wire (the backend table's client), score the same tokens with
Gyre's trainer, and compare log-probs (k3 = the estimate of KL(behaviour || trainer) the run's
step rows report as mismatch_k3_lag0)."""

from __future__ import annotations

import asyncio

import torch

from gyre.batch import expanded_batch
from gyre.config import TrainConfig
from gyre.engine import backends
from gyre.train.backends import make_trainer

PROMPTS = [[11, 12, 13, 14, 15], [21, 22, 23], [1, 882, 198, 40, 1000, 2000, 17, 198]]


def sample(backend: str, url: str, key: str | None, temperature: float, seed: int, max_new: int = 12,
           prompts=PROMPTS):
    """One generation per prompt; returns (micro-batch of their tokens with the engine's log-probs,
    the results)."""
    client_class = backends.get(backend).client_class

    async def run():
        async with client_class(url, api_key=key) as client:
            params = {"max_new_tokens": max_new, "temperature": temperature, "sampling_seed": seed,
                      "ignore_eos": True}
            return await asyncio.gather(*(client.generate(p, params) for p in prompts))

    results = asyncio.run(run())
    mb = expanded_batch([p + r.output_ids for p, r in zip(prompts, results)], [len(p) for p in prompts],
                        old_logprobs=[r.logprobs for r in results], advantages=[1.0] * len(prompts),
                        execution_index=list(range(len(prompts))),
                        temperature=temperature or 1.0)  # greedy: log-probs of the raw logits
    return mb, results


def trainer_for(model_dir, lr: float = 1e-3):
    return make_trainer(TrainConfig(backend="embedded", lr=lr, dtype="float32"), model_dir)


def mismatch(trainer, mb) -> dict:
    """k3 mean and max |log-ratio| of the trainer's log-probs against the engine's, over the targets."""
    with torch.no_grad():
        d = trainer.logprobs(mb) - mb.old_logprobs
    k3 = torch.expm1(d) - d
    return {"k3_mean": float(k3.mean()), "abs_max": float(d.abs().max()), "tokens": int(d.numel())}
