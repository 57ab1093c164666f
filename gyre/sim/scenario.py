"""One place that turns a preset (workload, model, layout), a scheme and a staleness rule into a
simulated run. The presets' numbers and their sources live in gyre/sim/calibration.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from gyre.config import Scheme
from gyre.sched import CoreSpec, Hints, RunSpec
from gyre.sim.calibration import KEEP_SOLO_SPEED, P122B, Preset, execs_per_cell, preset
from gyre.sim.cost_model import ClusterModel
from gyre.sim.run_loop import GaveUp
from gyre.sim.simulator import SimSpec, simulate
from gyre.sim.result import SimResult
from gyre.sim.workload import LognormalPreset, Workload

SEGMENTS = 8  # model-call/tool segments simulated per execution

# The paper's end-to-end hours: the 2.4T run (cluster size not stated; staleness "matched").
PAPER = {"E": 75.42, "A": 134.55, "C": 91.47,
         "max_speedup_over_async": 1.85, "max_speedup_over_colocate": 1.78}


def nl2repo_cluster(nodes: int = 32, cell_nodes: int = 4, **over) -> ClusterModel:
    """The 122B preset's cluster model for another node budget or cell size."""
    return P122B.cluster(nodes=nodes, cell_nodes=cell_nodes, **over)


def hints_for(cluster: ClusterModel, workload: Workload) -> Hints:
    """What a policy is told about costs in a simulated run: the numbers the coordinator would
    configure. E-paper's sizing (executions per rollout cell) comes from the decode model."""
    execs = [e for i in range(8) for e in workload.group(i).execs]
    tool = sum(e.tool_s for e in execs) / max(1e-9, sum(e.nominal_s for e in execs))
    ctx = sum(e.context_tokens for e in execs) / len(execs) / 2  # mean over an execution's calls
    return Hints(to_train_s=cluster.to_train_s, to_rollout_s=cluster.to_rollout_s, push_s=cluster.push_s,
                 eval_s=cluster.eval_s, execs_per_cell=execs_per_cell(cluster, max(0.05, 1 - tool), ctx),
                 train_tokens_per_s=cluster.train_tokens_per_s,
                 calls_per_cell=cluster.calls_per_cell(ctx, KEEP_SOLO_SPEED))


@dataclass(frozen=True)
class Scenario:
    scheme: str
    staleness: int
    cluster: ClusterModel
    workload: str | LognormalPreset = "nl2repo"  # preset (or its name) or trace path
    steps: int = 48
    groups_per_step: int = 16
    seed: int = 0                 # workload seed (the simulator itself has no randomness)
    record: bool = True
    async_rollout_cells: int = 0  # scheme A's rollout pool; 0 = half the cells
    staleness_rule: str = "window"
    steps_per_sync: int = 1
    preset: str = ""              # the preset it models (reported with the run)
    # a real run's spec this scenario sweeps around (`gyre plan --config`): its burst order,
    # zero-variance rule and seed are kept; the fields above replace the rest
    base: RunSpec | None = None
    router_spread: tuple = ()     # calls per endpoint of a live run's router; () = even (SimSpec.router_spread)

    def spec(self, workload: Workload) -> RunSpec:
        """The run spec simulated: the cluster model gives the cost hints a live run configures."""
        base = self.base or RunSpec(CoreSpec(steps=1, groups_per_step=1, group_size=1))
        rc = self.async_rollout_cells or max(1, self.cluster.cells // 2)
        return base.replace(scheme=self.scheme, hints=hints_for(self.cluster, workload), rollout_cells=rc,
                            steps=self.steps, groups_per_step=self.groups_per_step, group_size=workload.group_size,
                            staleness=self.staleness, staleness_rule=self.staleness_rule,
                            steps_per_sync=self.steps_per_sync)

    def run(self, workload: Workload | None = None, give_up_after: float = math.inf) -> SimResult:
        """The simulated run; with `give_up_after` (seconds), GaveUp once it is sure to take longer."""
        w = workload or Workload.named(self.workload, self.seed)
        sim = SimSpec(record=self.record, segments=SEGMENTS, router_spread=self.router_spread)
        r = simulate(self.spec(w), w, self.cluster, sim, give_up_after=give_up_after)
        r.preset = self.preset
        r.async_rollout_cells = (self.async_rollout_cells or max(1, self.cluster.cells // 2)) if self.scheme == Scheme.A else 0
        return r

    def with_(self, **kw) -> "Scenario":
        return replace(self, **kw)


SCREEN_STEPS = 4  # horizon of the short runs that seed a long search (a tenth of the work at 24+ steps)


def best_async(s: Scenario, workload: Workload | None = None, search: bool = False,
               prune: bool = False, screen_steps: int = 0) -> tuple[SimResult, dict[int, float]]:
    """Scheme A at its best split of 1 .. n-1 rollout cells: the fastest run and hours per split
    simulated. A fair comparison gives Async its best split, not half the cells by fiat.

    By default every split runs. With ``search`` (``gyre plan``: 15 splits at 16 cells is most of a
    plan's time) a coarse grid of about six splits runs first, then the neighbours of the best one
    (one at a time: a faster one moves the walk on at once) until neither is faster: hours against the split are close to unimodal (too few rollout cells
    starve the trainers, too many leave them slow), and the neighbour walk corrects a coarse grid
    that landed beside a local dip. Up to 6 splits, search is the exhaustive sweep.

    With ``prune`` a split's run is given up once its clock passes the fastest makespan so far
    (it cannot be the best): the same best split and hours, for less simulation; the hours per
    split then hold the runs that finished, and the best run's ``async_given_up`` the others (split
    -> hours simulated when given up, a lower bound on theirs). The coarse grid then runs from the
    middle of the range outwards, so a fast split is usually known early.

    With ``screen_steps`` (a search over more steps than that, and more than 3 splits) the search
    runs first at that short horizon, in place of the coarse grid, and the full-length walk starts
    from the split it found: a run near the best split is given up only once it reaches the best
    makespan, so each full-length run costs almost a whole run, and the walk needs three of them
    (the best and its two neighbours) when the screen found the best. The walk still ends only at
    a split whose neighbours are both slower at full length, so the answer is the search's answer
    wherever hours are unimodal in the split."""
    n = s.cluster.cells
    if n < 2:
        raise ValueError(f"async needs a rollout pool and a training pool; {n} cell cannot hold both")
    w = workload or Workload.named(s.workload, s.seed)
    runs: dict[int, SimResult] = {}
    given_up: dict[int, float] = {}  # split -> seconds simulated when its run was given up
    cell_s, serial_s = train_pool_floor_s(s, w) if prune else (0.0, 0.0)

    def at(k: int) -> None:
        if k in runs or k in given_up:
            return
        limit = min((r.makespan_s for r in runs.values()), default=math.inf) if prune else math.inf
        floor = cell_s / (n - k) + serial_s
        if floor > limit:  # its training pool alone takes longer than the best run: not simulated
            given_up[k] = floor
            return
        try:
            runs[k] = s.with_(scheme="A", async_rollout_cells=k).run(w, give_up_after=limit)
        except GaveUp as e:
            given_up[k] = e.at

    def best() -> int:
        return min(runs, key=lambda k: (runs[k].makespan_s, k))

    splits = range(1, n)
    order = (lambda k: (abs(2 * k - n), k)) if prune else None
    screened = search and 0 < screen_steps < s.steps and len(splits) > 3
    if not screened and (not search or len(splits) <= 6):
        for k in sorted(splits, key=order):
            at(k)
    else:
        if screened:  # seed the walk with the best split of short runs
            short, _ = best_async(s.with_(steps=screen_steps), w, search=True, prune=prune)
            at(short.async_rollout_cells)
        else:
            stride = max(1, round(len(splits) / 6))
            # order does not change what is found (a given-up run is slower than one that finished)
            for k in sorted({*splits[::stride], n - 1}, key=order):
                at(k)
        while True:  # walk to a local minimum around the best split seen
            b = best()
            fresh = [k for k in (b + 1, b - 1) if 1 <= k < n and k not in runs and k not in given_up]
            if not fresh:
                break
            # one neighbour at a time, so that one that is faster moves the walk on before the other
            # side runs; the smaller training pool first: where it is slower, its training floor
            # often skips it without a run
            at(fresh[0])
    b = best()
    runs[b].async_given_up = {k: t / 3600 for k, t in sorted(given_up.items())}
    return runs[b], {k: r.hours for k, r in sorted(runs.items())}


def train_pool_floor_s(s: Scenario, w: Workload) -> tuple[float, float]:
    """A floor on an Async run's makespan from its training pool alone, as (cell-seconds, seconds):
    split k takes at least cell-seconds / (cells - k) + seconds. Cell-seconds: the training tokens
    of the run's groups at one cell's rate; seconds: an optimizer step per step. The groups trained
    are the first ones started but for stale drops and their replacements, so the tokens are the
    smallest steps x groups-per-step totals among the groups a run can start before its window
    closes on them."""
    need = s.steps * s.groups_per_step
    seen = need + (s.staleness + 1) * s.steps_per_sync * s.groups_per_step
    tokens = sorted(sum(e.train_tokens for e in w.group(i).execs) for i in range(seen))[:need]
    return sum(tokens) / s.cluster.train_tokens_per_s, s.steps * s.cluster.opt_s


def preset_scenario(name: str, scheme: str, staleness: int, **kw) -> Scenario:
    """A run of a named preset (its cluster, steps and queries per step)."""
    p = preset(name)
    over = kw.pop("cluster_over", {})
    return Scenario(scheme, staleness, p.cluster(**over), workload=kw.pop("workload", p.workload),
                    steps=kw.pop("steps", p.steps),
                    groups_per_step=kw.pop("groups_per_step", p.groups_per_step), preset=p.name, **kw)


def compare(s: Scenario, workload: Workload | None = None, schemes: tuple[str, ...] = ("E", "C", "A")) -> dict:
    """E, C and Async (best split and half split) at one point, at the scenario's staleness."""
    w = workload or Workload.named(s.workload, s.seed)
    out: dict = {}
    for scheme in schemes:
        if scheme == Scheme.A:
            if s.cluster.cells < 2:
                out["A_skipped"] = f"async needs >= 2 cells, the cluster has {s.cluster.cells}"
                continue
            best, by_split = best_async(s, w)
            half = max(1, s.cluster.cells // 2)
            out.update(A=best.hours, A_split=best.async_rollout_cells, A_half=by_split[half], A_by_split=by_split)
        else:
            out[scheme] = s.with_(scheme=scheme).run(w).hours
    return out


def pin_tool_time(p: Preset, seed: int = 0, target_h: float = 1.93, steps: int | None = None,
                  tol: float = 0.01, max_iter: int = 6) -> tuple[float, list]:
    """The tool time per execution at which the preset's own E0 run averages the paper's measured
    rollout (1.93 h): the profile is a secondary figure, and tool time is the one part of an
    execution's duration that no token count gives. Decode and prefill stay physical; the
    iteration moves only the tool time (duration is linear in it at a fixed load)."""
    wl, trail = p.workload, []
    for _ in range(max_iter):
        r = Scenario("E", 0, p.cluster(), workload=wl, steps=steps or min(p.steps, 6),
                     groups_per_step=p.groups_per_step, seed=seed, record=False).run()
        trail.append((round(wl.mean_tool_s), round(r.mean_rollout_h, 3)))
        err = target_h * 3600 - r.mean_rollout_h * 3600
        if abs(err) <= tol * target_h * 3600:
            break
        wl = replace(wl, mean_tool_s=max(0.0, wl.mean_tool_s + err))
    return wl.mean_tool_s, trail
