"""The simulator's run loop: from one event to the next until the last step has trained.

It runs once per event, so the decode speed, the next event's time, the advance of the clock to
it (with the figures the loop already holds: the busy set, the run's diagnostics, the decode
clocks and training's drain) and the events due are worked out inline, on the Simulator's own
state (gyre.sim.simulator: the model of what each event does); the rarer kinds of event go to
its `_event`. A module of its own so that the model and the loop that drives it read apart; the
loop is the simulator's hottest code (hand-specialized: see the comment on `while True`), so it
reads the simulator's fields directly rather than through calls.
"""

from __future__ import annotations

import math
from heapq import heappop

EPS = 1e-9
# kinds of queued event
ENV, EVAL, SWITCH, PUSH, TICK, OPT, PREFILL = range(7)


class SimError(RuntimeError):
    """The simulation cannot make progress (a policy that never trains, a deadlock)."""


class GaveUp(Exception):
    """The run was stopped once its clock passed `give_up_after`: its makespan is longer (a search
    that already has a run that fast does not need the rest of this one)."""

    def __init__(self, at: float) -> None:
        super().__init__(f"given up at {at:.0f} s")
        self.at = at


def run_events(sim, give_up_after: float = math.inf) -> None:
    """Handle the events of `sim` (a gyre.sim.simulator.Simulator, its first decision taken) until
    the last step has trained; GaveUp once the next event lies past `give_up_after`."""
    idle_ticks = 0
    core, steps = sim.core, sim.core.spec.steps  # core.done: version >= steps
    pool = sim.pool
    rate_fn, lane_speeds, tps = pool.rate, pool.lane_speeds, sim._tps
    end_call, decode, end_env, event, drain = sim._end_call, pool.add, sim._end_env, sim._event, sim._drain
    events, lanes, vclocks, lane_calls, mbq = sim.events, pool.lanes, pool.vclocks, pool.calls, sim.mb_queue
    one = len(lanes) == 1  # the pooled decode: one lane (the common case, kept short)
    calls0 = lanes[0]
    inf = math.inf
    n_cells, reps, diag, busy = sim._n_cells, sim._reps, sim.diag, sim.busy
    knee = diag.knee
    # the loop's own cache of the decode speed (`DecodePool.speed`'s, without building its key per event)
    k_n, k_serving, k_cs, k_lanes, speed = -1, -1, -1.0, None, pool.speed_v
    # `while True`: its unconditional back edge is where CPython 3.11 specializes a running
    # function's code (a `while cond` loop's conditional one is not; the loop once ran three
    # times the dictionary lookups per event for it)
    while True:
        if core.version >= steps:
            break
        # the decode speed per lane (DecodePool.speed): nothing changes it between the next event's time
        # and the advance to it
        now, n, cs, n_rollout = sim.now, pool.in_call, pool.ctx_sum, sim.n_rollout
        pushing = now < sim.push_until - EPS
        serving = 0 if pushing else n_rollout
        if one:
            if n != k_n or serving != k_serving or cs != k_cs:
                k_n, k_serving, k_cs = n, serving, cs
                speed = (rate_fn(n, serving, cs / n if n else 0.0),)
        else:
            key = tuple(lane_calls)
            if n != k_n or serving != k_serving or cs != k_cs or key != k_lanes:
                k_n, k_serving, k_cs, k_lanes = n, serving, cs, key
                speed = lane_speeds(serving)
        # the next event: a queued one, a call's end in a lane, or the open step's training end
        t = events[0][0] if events else inf
        if one:
            v = speed[0]
            if calls0 and v > 0:
                d = calls0[0][0] - vclocks[0]
                x = now + (d if d > 0.0 else 0.0) / v  # max(0.0, d)
                if x < t:
                    t = x
        else:
            for calls, vc, v in zip(lanes, vclocks, speed):
                if calls and v > 0:
                    d = calls[0][0] - vc
                    x = now + (d if d > 0.0 else 0.0) / v
                    if x < t:
                        t = x
        left = sim.train_left
        rate = sim.n_train * tps
        drains = left > EPS and rate > 0
        if drains:
            x = now + left / rate
            if x < t:
                t = x
        if t > give_up_after or t == inf:  # (strictly: a run as fast as the limit may win a tie)
            if t == inf:
                raise SimError(f"{sim.p.label}: nothing left to happen at t={sim.now:.0f}s")
            raise GaveUp(t)  # its makespan is at least t
        dt = t - now
        if dt > 0:  # move the clock to t
            # During the optimizer step trainers are busy; during a weight push rollout cells pause.
            optimizing = now < sim.opt_until - EPS
            key = (sim.roles_rev, n if n < n_rollout else n_rollout, pushing, drains or optimizing)
            if key != busy.key:
                busy.update(key, now)
            running = sim.running
            if running and not n_rollout:
                diag.unserved += dt
            if diag.win_open:
                spare = n_cells - n / knee
                diag.win_spare += (spare if spare > 0.0 else 0.0) * dt  # max(0.0, spare)
            # Regime: rollout is the critical path while executions run (or await evaluation)
            # and the trainers have nothing admitted to train.
            if (running or sim.awaiting_eval) and left <= EPS and not optimizing:
                diag.crit_roll += dt
            if n and n_rollout and not pushing:  # calls per busy replica (ClusterModel.batch)
                b = n / (n_rollout * reps)
                diag.load_num += n * (b if b > 1.0 else 1.0) * dt
                diag.load_den += n * dt
            if one:
                vclocks[0] += speed[0] * dt
            else:
                for i, v in enumerate(speed):
                    vclocks[i] += v * dt
            if drains:
                d = rate * dt
                if d > left:  # min(left, rate * dt)
                    d = left
                if mbq and mbq[0][1] > d + 1e-3:  # _drain when the head micro-batch takes it all
                    sim.train_left = left - d
                    mb, rem = mbq[0]
                    mbq[0] = (mb, rem - d)
                else:
                    drain(d)
            sim.now = t
        # everything due now: calls that ended, then events (most are a call's prefill or its
        # tool time). Calls and tool time inside an execution change nothing a policy decides
        # on, so only execution ends, evaluations, switches, step ends and ticks wake the policy.
        progressed = wake = False
        done = 0
        if one:
            if calls0:
                vc = vclocks[0]
                due = vc + EPS * (vc if vc > 1.0 else 1.0)  # max(1.0, vc)
                while calls0 and calls0[0][0] <= due:
                    end_call(heappop(calls0)[2])
                    done += 1
        else:
            for calls, vc in zip(lanes, vclocks):
                if calls:
                    due = vc + EPS * (vc if vc > 1.0 else 1.0)
                    while calls and calls[0][0] <= due:
                        end_call(heappop(calls)[2])
                        done += 1
        progressed = done > 0
        due = sim.now + EPS
        while events and events[0][0] <= due:
            _, _, kind, obj = heappop(events)
            done += 1
            if kind == PREFILL:
                progressed = True
                decode(obj)
            elif kind == ENV:
                progressed = True
                if end_env(obj):
                    wake = True
            elif kind == TICK:
                sim._push(sim.now + sim.s.tick_s, TICK, None)
                wake = True
            else:
                progressed = wake = True
                event(kind, obj)
        sim.n_events += done
        if sim._maybe_ready and not sim.opt_until:
            sim._maybe_ready = False
            if core.step_ready():
                progressed = wake = True
                sim._ready()
        progressed |= sim.train_left < left  # training drained work (a long step has no events)
        if core.version >= steps:
            break
        idle_ticks = 0 if progressed else idle_ticks + 1
        if idle_ticks > 1000:
            raise SimError(f"{sim.p.label}: no progress for 1000 ticks at t={sim.now:.0f}s")
        if wake:
            sim._decide()
