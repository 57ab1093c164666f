"""gyre.sim: a discrete-event simulator that drives the gyre.sched policies, unchanged.

    from gyre.sim.scenario import Scenario, nl2repo_cluster
    result = Scenario("E", 0, nl2repo_cluster()).run()   # 48 steps, 32 nodes, NL2RepoBench preset
    result.hours, result.lower_bound_hours, result.cell_stats, result.step_stats

Modules: workload (presets, trace files), cluster (decode/training/switch costs), engine (the
event loop), bound (lower bound), scenario (calibration and one-call runs), plan (`gyre plan`).
"""
