"""The paced replica (``engine.pace``, benchmarks only): the embedded engine as a loaded GPU replica.

The tiny CPU model decodes a batch of 12 in ~8 ms whatever the load, so live runs of it are
latency-bound and cannot rank schedulers. With ``engine.pace = true`` every batched decode step of
the embedded engine lasts (at least) the roofline step time of its batch under :data:`PACED_REPLICA`
(``gyre.sim.roofline.ReplicaSpec.step_s``): the engine sleeps what is left of that time after its
own compute. The simulator of a benchmark uses the same spec, so the live run and its simulation
share one decode formula. Nothing is added to the HTTP API: pacing is internal to the engine.

The spec is a *scaled* replica, not a real GPU (stated, not measured):

- 15 ms per step at batch 1 (5 ms overhead + 10 GB of weights over 1 TB/s), so two busy CPU cores
  keep up with the tiny model's real compute (~3-8 ms a step);
- 12.5 MB of KV read per token of context (a real 8B model reads ~128 KB; inflated ~100x so the
  embedded engine's contexts of a few hundred tokens load it as tens of thousands load a real
  replica): at 300 tokens of context each call adds 3.75 ms to a step, so beyond ~4 calls a
  replica is throughput-bound (at most ~270 tokens/s however large the batch);
- prefill is not paced (the engine's real prefill runs); the spec's prefill rate (2 x 1e9 FLOPs
  per token at 60 TFLOPS x 0.5) is ~15k tokens/s, the tiny model's measured CPU prefill on the
  2-core development machine (300 tokens in ~20 ms);
- KV capacity is not the spec's: the engine's prefix cache limits live (a benchmark sets
  ``ClusterModel.kv_tokens_per_replica`` from :func:`prefix_cache_tokens`).
"""

from __future__ import annotations

import time

from gyre.sim.roofline import ReplicaSpec

PACED_REPLICA = ReplicaSpec(gpus=1, hbm_gb=80.0, hbm_tb_s=1.0, peak_tflops=60.0, dense_gb=10.0, expert_gb=0.0,
                            kv_bytes_per_token=1.25e7, overhead_ms=5.0, active_params=1.0e9, prefill_mfu=0.5)


def paced_step_s(batch: int, contexts: list[int] | None = None, spec: ReplicaSpec = PACED_REPLICA) -> float:
    """Seconds one decode step of `batch` calls lasts under the paced spec; `contexts` are the
    calls' context lengths in tokens (their mean is what the roofline reads per call)."""
    ctx = sum(contexts) / len(contexts) if contexts else 0.0
    return spec.step_s(batch, ctx)


def prefix_cache_tokens(prefix_cache_mb: int, layers: int, kv_heads: int, head_dim: int) -> int:
    """Tokens the embedded engine's prefix cache holds (float32 keys and values, as runtime.Engine)."""
    return max(1, (prefix_cache_mb << 20) // (2 * layers * kv_heads * head_dim * 4))


class Pacer:
    """Holds each engine round with a decode step to the paced duration of that step.

    ``start()`` when the round begins (its prefill chunks and the decode step's compute run
    inside the paced time, as the simulator assumes prefill overlaps memory-bound decoding);
    ``finish(batch, contexts)`` after the decode compute sleeps what is left, less the time the
    engine spends afterwards handing the tokens out (sampling, stop checks: measured by ``done()``
    and carried over as a running estimate), so a round lasts the paced step time. Counts steps
    whose compute alone ran past the paced time (``overruns``: the CPU could not keep up)."""

    TAIL_WEIGHT = 0.3  # weight of the newest measurement in the hand-out time estimate

    def __init__(self, spec: ReplicaSpec = PACED_REPLICA, sleep=time.sleep, clock=time.monotonic) -> None:
        self.spec, self._sleep, self._clock = spec, sleep, clock
        self.steps = 0
        self.overruns = 0
        self.paced_s = 0.0   # sum of the paced step times
        self.tail_s = 0.0    # estimate of the hand-out time after a step
        self._t0 = 0.0
        self._t_slept: float | None = None

    def start(self) -> None:
        self._t0 = self._clock()
        self._t_slept = None

    def finish(self, batch: int, contexts: list[int]) -> float:
        """Sleep out the step (less the expected hand-out time); returns its paced duration."""
        target = paced_step_s(batch, contexts, self.spec)
        left = target - (self._clock() - self._t0) - self.tail_s
        self.steps += 1
        self.paced_s += target
        if left > 0:
            self._sleep(left)
        else:
            self.overruns += 1
        self._t_slept = self._clock()
        return target

    def done(self) -> None:
        """The step's tokens are handed out: update the hand-out time estimate."""
        if self._t_slept is None:
            return
        took = self._clock() - self._t_slept
        self.tail_s = took if self.steps == 1 else (1 - self.TAIL_WEIGHT) * self.tail_s + self.TAIL_WEIGHT * took
        self._t_slept = None
