"""engine.pace: the embedded engine's decode steps follow the paced replica's roofline.

No wall-clock assertions: the pacer's clock and sleep are replaced by a virtual clock, so what is
checked is which batches the engine stepped and how long the spec says each step lasts (the
measured figures are in benchmarks/bench_live_sched.py)."""

from __future__ import annotations

import threading

import pytest

from gyre.config import load_config
from gyre.engine.pace import PACED_REPLICA, Pacer, paced_step_s, prefix_cache_tokens
from gyre.engine.runtime import Engine
from gyre.engine.sampling import SamplingParams
from gyre.model.tiny import ensure_tiny_model

PROMPT = [1, 882, 198, 40, 1000, 2000, 17, 2, 198, 1, 77, 198]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.getbasetemp() / "tiny-qwen")


class VirtualPacer(Pacer):
    """A pacer on a virtual clock: the engine's compute takes no virtual time, each sleep advances
    it; every step's (batch, contexts, paced seconds) is kept."""

    def __init__(self) -> None:
        self.now = 0.0
        super().__init__(sleep=self._advance, clock=lambda: self.now)
        self.log: list[tuple[int, list[int], float]] = []

    def _advance(self, s: float) -> None:
        self.now += s

    def finish(self, batch, contexts):
        t = super().finish(batch, contexts)
        self.log.append((batch, list(contexts), t))
        return t


def run_batch(engine: Engine, n: int, new_tokens: int) -> list:
    """Submit n requests at once (the worker admits them in one round) and wait for all."""
    done, results = threading.Event(), []
    lock = threading.Lock()

    def on_done(f):
        with lock:
            results.append(f)
            if len(results) == n:
                done.set()

    with engine._cv:  # the worker cannot admit any until all are queued
        for i in range(n):
            engine.submit(f"r{n}-{i}", PROMPT, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True,
                                                              temperature=0.0), on_done)
    assert done.wait(120), "requests did not finish"
    return results


def test_spec_is_latency_bound_below_the_knee_and_throughput_bound_beyond():
    ctx = 300
    steps = [paced_step_s(b, [ctx] * b) for b in (1, 2, 4, 8, 16, 32, 64)]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)  # a bigger batch, a longer step
    rates = [b / s for b, s in zip((1, 2, 4, 8, 16, 32, 64), steps)]
    assert rates == sorted(rates)  # more calls never lower the replica's throughput ...
    ceiling = PACED_REPLICA.bandwidth / (ctx * PACED_REPLICA.kv_bytes_per_token)
    assert rates[-1] < ceiling and rates[-1] > 0.9 * ceiling  # ... which saturates at the KV-read bound
    # per-call speed halves once the KV read equals the fixed part of the step (the knee)
    knee = (PACED_REPLICA.overhead_ms / 1e3 * PACED_REPLICA.bandwidth + PACED_REPLICA.dense_gb * 1e9) / (
        ctx * PACED_REPLICA.kv_bytes_per_token)
    assert paced_step_s(round(knee), [ctx] * round(knee)) == pytest.approx(2 * paced_step_s(1, [0]), rel=0.1)
    assert 2 <= knee <= 8  # a few calls per replica: the regime the live check needs


def test_pacer_sleeps_the_rest_of_the_step_and_counts_overruns():
    clock = [0.0]
    slept = []
    p = Pacer(sleep=lambda s: (slept.append(s), clock.__setitem__(0, clock[0] + s)), clock=lambda: clock[0])
    p.start()
    clock[0] += 0.004  # 4 ms of compute
    target = p.finish(2, [100, 300])
    assert target == pytest.approx(PACED_REPLICA.step_s(2, 200))
    assert slept == [pytest.approx(target - 0.004)] and p.overruns == 0
    p.start()
    clock[0] += 10.0  # compute longer than any paced step: no sleep, one overrun
    p.finish(1, [10])
    assert len(slept) == 1 and p.overruns == 1 and p.steps == 2


def test_pacer_counts_the_hand_out_time_inside_the_step():
    clock = [0.0]
    slept = []
    p = Pacer(sleep=lambda s: (slept.append(s), clock.__setitem__(0, clock[0] + s)), clock=lambda: clock[0])
    rounds = []
    for _ in range(3):  # compute 4 ms, hand-out 2 ms
        t = clock[0]
        p.start()
        clock[0] += 0.004
        target = p.finish(4, [300] * 4)
        clock[0] += 0.002
        p.done()
        rounds.append(clock[0] - t)
    # the first round cannot know the hand-out time; from the second on a round lasts the step
    assert rounds[0] == pytest.approx(target + 0.002)
    assert rounds[1:] == [pytest.approx(target), pytest.approx(target)]
    assert p.tail_s == pytest.approx(0.002)


def test_paced_engine_steps_follow_the_spec_for_its_batch(tiny):
    engine = Engine(tiny, pace=True)
    try:
        assert isinstance(engine.pacer, Pacer)
        engine.pacer = VirtualPacer()
        new = 6
        one = run_batch(engine, 1, new)
        single = list(engine.pacer.log)
        engine.pacer.log.clear()
        four = run_batch(engine, 4, new)
        batched = list(engine.pacer.log)
    finally:
        engine.close()
    assert all(len(f.output_ids) == new for f in one + four)
    # the first token comes from the prefill; each later one from one paced decode step of the batch
    assert [b for b, _, _ in single] == [1] * (new - 1)
    assert [b for b, _, _ in batched] == [4] * (new - 1)
    for b, ctxs, t in single + batched:
        assert len(ctxs) == b and t == pytest.approx(PACED_REPLICA.step_s(b, sum(ctxs) / b))
    # contexts grow by one token a step (the KV the step reads)
    assert [c[0] for _, c, _ in single] == list(range(len(PROMPT), len(PROMPT) + new - 1))
    # per-token latency grows with the batch as the spec says; throughput grows less than the batch
    lat1 = sum(t for _, _, t in single) / (new - 1)
    lat4 = sum(t for _, _, t in batched) / (new - 1)
    assert lat4 / lat1 == pytest.approx(PACED_REPLICA.step_s(4, len(PROMPT) + 2) / PACED_REPLICA.step_s(1, len(PROMPT) + 2), rel=0.02)
    assert 1 < lat4 / lat1 < 4


def test_pace_is_off_by_default_and_set_from_config(tiny):
    assert load_config(None, []).engine.pace is False
    assert load_config(None, ["engine.pace=true"]).engine.pace is True
    engine = Engine(tiny)
    try:
        assert engine.pacer is None
    finally:
        engine.close()
    # the prefix cache the benchmark gives the simulator is the engine's own
    s = engine.spec
    assert prefix_cache_tokens(256, s.layers, s.kv_heads, s.head_dim) == engine._prefix.budget_tokens
