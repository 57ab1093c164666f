"""gyre.sim: a discrete-event simulator that drives the gyre.sched policies and coordinator core, unchanged.

    from gyre.sim.scenario import preset_scenario
    result = preset_scenario("nl2repo-122b-32n", "E", 0).run()   # 32 nodes, 8 cells x 4, 24 steps
    result.hours, result.lower_bound_hours, result.lag, result.rollout_critical_share

Modules: workload (profiles, trace files), calibration (presets: model, hardware, layout and the
source of every number), cost_model (decode/training/switch/re-prefill costs), simulator (what each
event does, around gyre.sched.core.Coordinator; it tells gyre.events, and its figures come from
gyre.events.RunStats as a live run's do), run_loop (its event loop), decode_pool (calls in flight),
prefix_cache (homes and KV held per cell), diagnostics (regime figures, busy stretches, the
result), result (what a run reports), bound (lower bound on the work trained), scenario (one-call
runs, policy hints), plan (`gyre plan`).
"""
