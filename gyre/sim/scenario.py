"""One place that turns a preset (workload, model, layout), a scheme and a staleness rule into a
simulated run. The presets' numbers and their sources live in gyre/sim/calibration.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gyre.sched import Hints, Policy, make_policy
from gyre.sim.calibration import P122B, execs_per_cell, preset
from gyre.sim.cluster import ClusterModel
from gyre.sim.engine import SimSpec, simulate
from gyre.sim.result import SimResult
from gyre.sim.workload import Workload

SEGMENTS = 8  # model-call/environment segments simulated per execution

# The paper's end-to-end hours: the 2.4T run (cluster size not stated; staleness "matched").
PAPER = {"E": 75.42, "A": 134.55, "C": 91.47,
         "max_speedup_over_async": 1.85, "max_speedup_over_colocate": 1.78}


def nl2repo_cluster(nodes: int = 32, cell_nodes: int = 4, **over) -> ClusterModel:
    """The 122B preset's cluster model for another node budget or cell size."""
    return P122B.cluster(nodes=nodes, cell_nodes=cell_nodes, **over)


def hints_for(cluster: ClusterModel, workload: Workload, keep_solo_speed: float = 0.0) -> Hints:
    """What a policy is told about costs: the same numbers the coordinator would configure. E's
    sizing (executions per rollout cell) is derived from the decode model, not a constant."""
    mean_train = sum(e.train_tokens for i in range(8) for e in workload.group(i).execs) / (8 * workload.group_size)
    return Hints(to_train_s=cluster.to_train_s, to_rollout_s=cluster.to_rollout_s, push_s=cluster.push_s,
                 eval_s=cluster.eval_s, half_load=cluster.half_load, ref_load=cluster.ref_load,
                 model_share=workload.model_share, cell_scale=cluster.scale,
                 execs_per_cell=execs_per_cell(cluster, workload.model_share, keep_solo_speed),
                 mean_duration_s=workload.mean_duration_s, duration_sigma=workload.sigma,
                 train_tokens_per_exec=mean_train, train_tokens_per_s=cluster.train_tokens_per_s)


@dataclass(frozen=True)
class Scenario:
    scheme: str
    staleness: int
    cluster: ClusterModel
    workload: str = "nl2repo"     # preset name or trace path
    steps: int = 48
    groups_per_step: int = 16
    seed: int = 0                 # workload seed (the simulator itself has no randomness)
    record: bool = True
    async_rollout_cells: int = 0  # 0 = half the cells
    staleness_rule: str = "window"
    steps_per_sync: int = 1
    preset: str = ""              # the preset it models (reported with the run)
    keep_solo_speed: float = 0.0  # E's sizing target (0 = calibration.KEEP_SOLO_SPEED)

    def policy(self, workload: Workload) -> Policy:
        n = self.cluster.cells
        rc = self.async_rollout_cells or max(1, n // 2)
        return make_policy(self.scheme, self.staleness, hints_for(self.cluster, workload, self.keep_solo_speed),
                           rollout_cells=rc)

    def run(self, workload: Workload | None = None) -> SimResult:
        w = workload or Workload.named(self.workload, self.seed)
        spec = SimSpec(steps=self.steps, groups_per_step=self.groups_per_step, record=self.record,
                       segments=SEGMENTS, staleness_rule=self.staleness_rule,
                       steps_per_sync=self.steps_per_sync)
        r = simulate(self.policy(w), w, self.cluster, spec)
        r.preset = self.preset
        return r

    def with_(self, **kw) -> "Scenario":
        return replace(self, **kw)


def preset_scenario(name: str, scheme: str, staleness: int, **kw) -> Scenario:
    """A run of a named preset (its cluster, steps and queries per step)."""
    p = preset(name)
    over = kw.pop("cluster_over", {})
    return Scenario(scheme, staleness, p.cluster(**over), workload=p.workload.name, steps=kw.pop("steps", p.steps),
                    groups_per_step=kw.pop("groups_per_step", p.groups_per_step), preset=p.name, **kw)


def calibrate_ref_load(name: str, seed: int = 0, tol: float = 0.02, max_iter: int = 8, **preset_over) -> tuple[float, list]:
    """ref_load as a fixed point: the calls in flight per serving cell, as a call sees them, in the
    preset's own E0 run with that ref_load. Uses the load only, never an end-to-end time."""
    from gyre.sim.calibration import preset as get

    p = get(name).with_(**preset_over)
    ref, trail = p.ref_load, []
    w = Workload.named(p.workload.name, seed)
    for _ in range(max_iter):
        r = Scenario("E", 0, p.with_(ref_load=ref).cluster(), workload=p.workload.name, steps=p.steps,
                     groups_per_step=p.groups_per_step, seed=seed, record=False).run(w)
        trail.append((round(ref, 3), round(r.mean_load, 3), round(r.mean_rollout_h, 3)))
        if abs(r.mean_load - ref) <= tol * ref:
            return ref, trail
        ref = r.mean_load
    return ref, trail
