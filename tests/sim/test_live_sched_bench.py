"""benchmarks/bench_live_sched.py's pieces that decide what is reported: the gate on the paced
engines, the per-engine decode figures it reads, the router's spread, and the aggregation over
repeats (medians over accepted runs only, rankings and their agreement, rejections counted)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

_spec = importlib.util.spec_from_file_location(
    "bench_live_sched", Path(__file__).resolve().parents[2] / "benchmarks" / "bench_live_sched.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def call(endpoint: str, t0: float, t1: float, n_input: int = 300, n_output: int = 24):
    return SimpleNamespace(endpoint=endpoint, t_start=t0, t_end=t1, n_input=n_input, n_output=n_output)


def spec_s(n_output: int = 24, n_input: int = 300, batch: int = 1) -> float:
    """Seconds the paced spec gives a call decoding alone (batch 1) at its mean context."""
    return n_output * bench.PACED_REPLICA.step_s(batch, n_input + n_output / 2)


def test_an_engine_at_the_spec_reads_one_and_a_slow_engine_is_the_worst():
    calls = [call("http://a", 0.0, spec_s()), call("http://b", 0.0, 1.3 * spec_s())]
    got = bench.decode_vs_spec_calls(calls)
    assert got["decode_spec_by_engine"] == [pytest.approx(1.3, abs=1e-3), pytest.approx(1.0, abs=1e-3)]
    assert got["decode_spec_worst_engine"] == pytest.approx(1.3)
    assert got["decode_spec_tokens_per_token"] == pytest.approx(1.15)
    assert got["calls_per_endpoint"] == [1, 1]


def test_calls_sharing_an_engine_are_held_to_the_batched_step():
    # two calls together on one engine: each step lasts the batch-of-2 time, which is the spec
    t = spec_s(batch=2)
    got = bench.decode_vs_spec_calls([call("http://a", 0.0, t), call("http://a", 0.0, t)])
    assert got["decode_spec_worst_engine"] == pytest.approx(1.0)


@pytest.mark.parametrize("worst, passed", [(1.0, True), (1.099, True), (1.101, False), (1.4, False)])
def test_the_gate_rejects_a_run_whose_worst_engine_overran_the_tolerance(worst, passed):
    verdict = bench.gate({"decode_spec_worst_engine": worst}, tolerance=0.10)
    assert verdict["passed"] is passed
    assert (verdict["why"] is None) is passed
    if not passed:
        assert "overran" in verdict["why"] and f"{worst:.3f}" in verdict["why"]


def test_a_run_without_decode_records_is_rejected():
    verdict = bench.gate({"decode_spec_worst_engine": None})
    assert not verdict["passed"] and "no decode records" in verdict["why"]


def test_the_instantaneous_spread_weights_time_and_leaves_idle_engines_out():
    by = {"a": [call("a", 0.0, 2.0), call("a", 0.0, 1.0)],   # 2 in flight over [0, 1], 1 over [1, 2]
          "b": [call("b", 0.0, 1.0)],                          # 1 over [0, 1], then idle
          "c": [call("c", 3.0, 4.0)]}                          # alone over [3, 4]
    # [0, 1]: max 2, mean 1.5; [1, 2]: 1, 1 (b idle is left out); [2, 3]: nothing; [3, 4]: 1, 1
    assert bench.busiest_inflight_over_mean(by) == pytest.approx((2 + 1 + 1) / (1.5 + 1 + 1))


def run(repeat: int, name: str, live: float, sim: float, passed: bool = True, attempt: int = 0, share: float = 0.4):
    return {"repeat": repeat, "name": name, "attempt": attempt, "live_s": live, "sim_s": sim, "sim_s_even": sim * 0.9,
            "sim_over_live": sim / live, "train_share": share, "load_avg_1m": [1.0, 2.0],
            "gate": {"passed": passed, "why": None if passed else "an engine decoded 1.200 spec tokens per token"}}


def test_repeats_aggregate_medians_of_accepted_runs_and_count_the_rejected():
    runs = [run(0, "E", 60, 55), run(0, "A", 70, 66), run(0, "C", 65, 62),
            run(1, "E", 62, 56), run(1, "A", 66, 67), run(1, "C", 64, 61),
            run(2, "E", 500, 50, passed=False),  # a loaded machine: not used
            run(2, "E", 61, 57, attempt=1), run(2, "A", 71, 68), run(2, "C", 69, 63, share=0.3)]
    agg = bench.aggregate(runs, ["E", "A", "C"])
    assert agg["live_s_E"] == 61 and agg["live_s_E_min"] == 60 and agg["live_s_E_max"] == 62
    assert agg["live_s_E_runs"] == [60, 62, 61]
    assert agg["accepted_E"] == 3 and agg["runs_total"] == 10 and agg["runs_rejected"] == 1
    assert agg["rejections"][0]["repeat"] == 2 and "1.200" in agg["rejections"][0]["why"]
    assert agg["train_share_C"] == 0.4 and agg["train_share_C_min"] == 0.3
    # medians: live E 61 < C 65 < A 70; sim E 56 < C 62 < A 67
    assert agg["ranking_live"] == "E<C<A" and agg["ranking_sim"] == "E<C<A" and agg["ranking_matches"]
    # repeat 1 ranks live E < C < A (66 > 64): agrees; repeat 0 and 2 too
    assert agg["repeats_complete"] == 3 and agg["repeats_live_ranking_as_medians"] == 3
    # repeat 1's simulation ranks C < A (61 < 67) as live does; repeat 2: sim E<C<A, live E<C<A
    assert agg["repeats_sim_ranking_matches_live"] == 3


def test_a_repeat_with_a_rejected_scheme_is_not_complete_and_rankings_that_differ_are_counted():
    runs = [run(0, "E", 60, 55), run(0, "A", 64, 66), run(0, "C", 65.5, 62),
            run(1, "E", 62, 56), run(1, "A", 66, 60), run(1, "C", 64, 61, passed=False)]
    agg = bench.aggregate(runs, ["E", "A", "C"])
    assert agg["repeats_complete"] == 1
    assert agg["ranking_live"] == "E<A<C"          # medians: E 61, A 65, C 65.5
    assert agg["ranking_sim"] == "E<C<A"           # sim medians: E 55.5, A 63, C 62
    assert not agg["ranking_matches"]
    assert agg["repeats_sim_ranking_matches_live"] == 0


def test_serving_load_divides_call_time_by_the_time_a_cell_served():
    # a: 10 call-seconds over 10 s of rollout; b: 6 call-seconds, but its cell served only 3 s (it
    # trained the rest): b is the busier engine while serving, though it made fewer calls
    calls = [call("a", 0.0, 5.0), call("a", 1.0, 6.0), call("b", 0.0, 3.0), call("b", 0.0, 3.0)]
    loads = bench.serving_loads(calls, {"a": 0, "b": 1}, {0: 10.0, 1: 3.0})
    assert loads == [pytest.approx(2.0), pytest.approx(1.0)]


@pytest.mark.parametrize("url_cell, rollout_s", [({"a": 0}, {0: 10.0}), ({"a": 0, "b": 1}, {0: 10.0, 1: 0.0})])
def test_serving_load_is_unknown_when_an_engine_has_no_cell_or_no_rollout_time(url_cell, rollout_s):
    calls = [call("a", 0.0, 1.0), call("b", 0.0, 1.0)]
    assert bench.serving_loads(calls, url_cell, rollout_s) is None
