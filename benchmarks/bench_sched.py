"""Scheduler benchmarks: policy decision time at scale, and simulator speed.

- decision_ms_1024: median time of one ``decide(state, now)`` per scheme with 1,024 cells and
  10,000 running executions (goal: <= 10 ms).
- sim_events_per_s: events per second of the 8-step, 32-node E0 simulation.
- sim_s_64n: seconds of one E1 run of the 122B preset on 64 nodes (4-node cells) at its 24 steps;
  sim_s_1024n: the 2.4T preset on 1,024 nodes (64-node cells) at its 48 steps (issue 33's goal: under
  60 s on one core); plan_s_64n: `gyre plan --nodes 64` at its defaults (both cell sizes, E/A/C,
  staleness 0 and 2, the preset's 24 steps, one process per CPU: goal under 2 minutes) over
  plan_points_64n points (plan_s_per_point_64n each). The steps and processes are recorded beside
  them, and plan_cpu_s_64n, the CPU seconds of all its processes (wall time on a loaded machine
  says more about the load); `--steps N` runs all three at N steps (a quick look).

    python benchmarks/bench_sched.py        # writes benchmarks/results/sched.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import resource
import statistics
import sys
import time
from pathlib import Path

from gyre.sched import SCHEMES, CellView, ClusterState, ExecView, Role, make_policy
from gyre.sim import plan
from gyre.sim.scenario import Scenario, hints_for, nl2repo_cluster, preset_scenario
from gyre.sim.workload import Workload

OUT = Path(__file__).resolve().parent / "results" / "sched.json"
CELLS, RUNNING, REPEAT = 1024, 10_000, 30


def big_state(rng: random.Random, now: float, role_mix: str) -> ClusterState:
    """A mid-step cluster: executions of various ages, admitted work waiting to train."""
    if role_mix == "colocate":
        roles = [Role.ROLLOUT] * CELLS
    else:
        roles = [Role.ROLLOUT if i < CELLS // 2 else Role.TRAIN for i in range(CELLS)]
    cells = tuple(CellView(i, r, rng.uniform(0, now - 600)) for i, r in enumerate(roles))
    running = tuple(ExecView(i, i // 8, 10, rng.uniform(now - 4 * 3600, now)) for i in range(RUNNING))
    return ClusterState(version=10, staleness=2, groups_per_step=1280, group_size=8, cells=cells,
                        running=running, groups_open=RUNNING // 8 + 100, groups_waiting=40, step_groups=600,
                        train_tokens_left=3.0e9, calls_in_flight=int(RUNNING * 0.3))


def decision_ms() -> dict[str, float]:
    rng = random.Random(0)
    now = 10 * 3600.0
    w = Workload.named("nl2repo", 0)
    hints = hints_for(nl2repo_cluster(), w)
    out = {}
    for scheme in SCHEMES:
        policy = make_policy(scheme, 2, hints, rollout_cells=CELLS // 2)
        state = big_state(rng, now, "colocate" if scheme == "C" else "split")
        times = []
        for _ in range(REPEAT):
            # a new tuple of cells each time, as the live head builds one per decision (a policy
            # counts a tuple it has seen once only)
            fresh = dataclasses.replace(state, cells=tuple(list(state.cells)))
            t0 = time.perf_counter()
            policy.decide(fresh, now)
            times.append((time.perf_counter() - t0) * 1e3)
        out[scheme] = round(statistics.median(times), 3)
    return out


def sim_speed() -> dict:
    r = Scenario("E", 0, nl2repo_cluster(), steps=8, groups_per_step=256, record=False).run()
    return {"events": r.events, "wall_s": round(r.wall_s, 3), "events_per_s": round(r.events / r.wall_s)}


def planning_speed(steps: int | None = None) -> dict:
    """Simulator and `gyre plan` seconds at the goal's sizes (their presets' steps unless `steps`)."""
    out = {}
    for key, name, nodes, cells in (("64n", "nl2repo-122b-32n", 64, 4), ("1024n", "nl2repo-2.4t", 1024, 64)):
        s = preset_scenario(name, "E", 1, record=False, cluster_over={"nodes": nodes, "cell_nodes": cells},
                            **({"steps": steps} if steps else {}))
        t0, c0 = time.perf_counter(), time.process_time()
        s.run()
        out |= {f"sim_s_{key}": round(time.perf_counter() - t0, 2),
                f"sim_cpu_s_{key}": round(time.process_time() - c0, 2), f"sim_steps_{key}": s.steps}
    ap = argparse.ArgumentParser()
    plan.add_arguments(ap)
    args = ap.parse_args(["--nodes", "64"] + (["--steps", str(steps)] if steps else []))
    scs = plan.scenarios(args)
    jobs = plan.usable_cpus()
    t0, c0 = time.perf_counter(), _cpu_s()
    rows = list(plan.execute(scs, "inline", jobs=jobs))
    wall = time.perf_counter() - t0
    out |= {"plan_s_64n": round(wall, 2), "plan_cpu_s_64n": round(_cpu_s() - c0, 1), "plan_points_64n": len(rows),
            "plan_s_per_point_64n": round(wall / len(rows), 2), "plan_steps_64n": scs[0].steps,
            "plan_jobs_64n": min(jobs, len(scs)),
            "plan_failed_64n": sum(1 for r in rows if r.get("failed"))}
    return out


def _cpu_s() -> float:
    """CPU seconds of this process and its ended children (the plan's pool workers, reaped when
    the pool shuts down): a figure the machine's other load does not inflate as it does wall time."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="simulate every run at this many steps")
    steps = ap.parse_args().steps
    d = decision_ms()
    s = sim_speed()
    p = planning_speed(steps)
    doc = {"decision_ms_1024": d, "decision_setup": {"cells": CELLS, "running_executions": RUNNING,
                                                     "repeat": REPEAT, "statistic": "median", "goal_ms": 10},
           "sim_events_per_s": s["events_per_s"], "sim_run": {"label": "E0", "nodes": 32, "steps": 8, "groups_per_step": 256, **s}} | p
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(doc, indent=1), encoding="utf-8")
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
