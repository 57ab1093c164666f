"""SimSpec.router_spread: the simulated decode pool carries the router's measured imbalance.

A live router keeps each execution on one engine (affinity), so an uneven spread loads one engine
above the mean and its executions, the step's tail, decode slower. The simulator's pool is even
unless told the spread; these tests check that an even spread changes nothing, that an uneven one
slows a throughput-bound run and leaves a latency-bound one alone, and that bad shares are refused."""

from __future__ import annotations

import pytest

from gyre.config import ConfigError
from gyre.sim.cost_model import ClusterModel
from gyre.sim.roofline import ReplicaSpec
from gyre.sim.scenario import Scenario
from gyre.sim.simulator import SimSpec
from gyre.sim.workload import ExecSpec, GroupSpec, Workload

# throughput-bound beyond a few calls: 12.5 MB of KV read per token of context (as the paced engine)
REPLICA = ReplicaSpec(gpus=1, hbm_gb=80.0, hbm_tb_s=1.0, peak_tflops=60.0, dense_gb=10.0, expert_gb=0.0,
                      kv_bytes_per_token=1.25e7, overhead_ms=5.0, active_params=1.0e9, prefill_mfu=0.5)
CLUSTER = ClusterModel(nodes=3, cell_nodes=1, gpus_per_node=1, replica=REPLICA, train_tokens_per_s=5000.0,
                       to_train_s=0.1, to_rollout_s=0.1, push_s=0.0, eval_s=0.2, opt_s=0.05)


def workload(group_size: int) -> Workload:
    """Identical executions: 8 calls of 24 tokens, ~600 tokens of context at the end, 4 s of tools."""
    ex = ExecSpec(nominal_s=12.0, calls=8, tokens=600.0, train_tokens=600.0, context_tokens=600.0,
                  output_tokens=192.0, tool_s=4.0)
    return Workload(lambda i: GroupSpec(f"g{i}", (ex,) * group_size), group_size, "toy", 12.0, 0.0)


def run(spread: tuple = (), group_size: int = 8, scheme: str = "C"):
    sc = Scenario(scheme, 0, CLUSTER, steps=2, groups_per_step=4, record=False, router_spread=spread)
    return sc.run(workload(group_size))


@pytest.mark.parametrize("scheme", ["C", "E"])
def test_an_even_spread_of_identical_executions_gives_the_pooled_figures(scheme):
    off, even = run((), group_size=6, scheme=scheme), run((300, 300, 300), group_size=6, scheme=scheme)
    assert even.makespan_s == off.makespan_s
    assert [s["t_end"] for s in even.step_stats] == [s["t_end"] for s in off.step_stats]


def test_an_uneven_spread_slows_a_throughput_bound_run_and_more_imbalance_slows_it_more():
    # 32 executions on 3 engines: ~7 calls in flight each, past the knee
    even, mild, skewed = run(()), run((312, 248, 208)), run((500, 150, 118))
    assert even.makespan_s < mild.makespan_s < skewed.makespan_s


def test_one_execution_per_engine_is_not_slowed_by_the_spread():
    # 3 executions at a time on 3 engines: the lanes follow the running executions, so each engine
    # decodes one call at its solo speed however the shares fall; only a loaded engine is slower
    def one_group(spread):
        return Scenario("C", 0, CLUSTER, steps=2, groups_per_step=1, record=False,
                        router_spread=spread).run(workload(3))

    assert one_group((2, 1, 1)).makespan_s == one_group(()).makespan_s


@pytest.mark.parametrize("spread", [(300, 0, 200), (1, -1), (float("nan"), 1)])
def test_shares_that_are_not_positive_are_refused(spread):
    with pytest.raises(ConfigError, match="router_spread"):
        SimSpec(router_spread=spread)
