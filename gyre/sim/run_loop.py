"""The simulator's run loop: from one event to the next until the last step has trained.

One turn per event, in four phases: the decode speed, the next event's time, the advance of
the clock to it (with the figures that accrue over the stretch: the busy set, the run's
diagnostics, the decode clocks and training's drain) and the calls and events due then, worked
out on the Simulator's own state (gyre.sim.simulator: the model of what each event does); the
rarer kinds of event go to its `_event`. A module of its own so that the model and the loop that
drives it read apart. The loop is the simulator's hottest code (hand-specialized: see the comment
on `while True`): each phase is a closure bound once per run to the fields it reads (a closure's
cells read as fast as locals), so a turn costs four calls more than the one-function loop (a few
per cent of its events per second) and reads through `sim` only what changes per event; the
figures are bit-identical to the single-function loop (benchmarks/sim_fingerprints.py).
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
    the last step has trained; GaveUp once the next event lies past `give_up_after`.

    One turn of the loop has four phases, each a step function bound once to the run's state
    (below): the decode speed, the next event's time, the advance of the clock to it, and the
    calls and events due then; what is left here is their order and the run's end."""
    idle_ticks = 0
    core, steps = sim.core, sim.core.spec.steps  # core.done: version >= steps
    pool, tps, inf = sim.pool, sim._tps, math.inf
    speed_at, next_time = _decode_speed(sim), _next_event(sim)
    advance, handle_due = _clock(sim), _due(sim)
    # `while True`: its unconditional back edge is where CPython 3.11 specializes a running
    # function's code (a `while cond` loop's conditional one is not; the loop once ran three
    # times the dictionary lookups per event for it)
    while True:
        if core.version >= steps:
            break
        now, n, n_rollout = sim.now, pool.in_call, sim.n_rollout
        pushing = now < sim.push_until - EPS
        # the decode speed per lane: nothing changes it between the next event's time and the advance to it
        speed = speed_at(0 if pushing else n_rollout)
        left = sim.train_left
        rate = sim.n_train * tps
        drains = left > EPS and rate > 0
        t = next_time(now, speed, left, rate, drains)
        if t > give_up_after or t == inf:  # (strictly: a run as fast as the limit may win a tie)
            if t == inf:
                raise SimError(f"{sim.p.label}: nothing left to happen at t={sim.now:.0f}s")
            raise GaveUp(t)  # its makespan is at least t
        if t - now > 0:  # move the clock to t
            advance(now, t, speed, n, n_rollout, pushing, left, rate, drains)
        done, progressed, wake = handle_due()
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


# --- the phases of one turn: each a factory that binds the run's state once and returns the step
# function the loop calls (closures read their cells as fast as locals; `sim`'s attributes that
# change per event are read through `sim`)

def _decode_speed(sim):
    """`speed_at(serving)`: tokens per second per lane (DecodePool.speed's, with the loop's own
    cache: no key tuple built per event on the one-lane path)."""
    pool = sim.pool
    rate_fn, lane_speeds, lane_calls = pool.rate, pool.lane_speeds, pool.calls
    k_n, k_serving, k_cs, k_lanes, speed = -1, -1, -1.0, None, pool.speed_v

    if len(pool.lanes) == 1:  # the pooled decode: one lane (the common case, kept short)
        def speed_at(serving: int) -> tuple:
            nonlocal k_n, k_serving, k_cs, speed
            n, cs = pool.in_call, pool.ctx_sum
            if n != k_n or serving != k_serving or cs != k_cs:
                k_n, k_serving, k_cs = n, serving, cs
                speed = (rate_fn(n, serving, cs / n if n else 0.0),)
            return speed
    else:
        def speed_at(serving: int) -> tuple:
            nonlocal k_n, k_serving, k_cs, k_lanes, speed
            n, cs = pool.in_call, pool.ctx_sum
            key = tuple(lane_calls)
            if n != k_n or serving != k_serving or cs != k_cs or key != k_lanes:
                k_n, k_serving, k_cs, k_lanes = n, serving, cs, key
                speed = lane_speeds(serving)
            return speed
    return speed_at


def _next_event(sim):
    """`next_time(now, speed, left, rate, drains)`: the next event's time: a queued one, a call's
    end in a lane, or the open step's training end (inf: none)."""
    pool, events, inf = sim.pool, sim.events, math.inf
    lanes, vclocks = pool.lanes, pool.vclocks
    calls0 = lanes[0]
    one = len(lanes) == 1

    def next_time(now: float, speed: tuple, left: float, rate: float, drains: bool) -> float:
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
        if drains:
            x = now + left / rate
            if x < t:
                t = x
        return t
    return next_time


def _clock(sim):
    """`advance(now, t, ...)`: move the clock from `now` to `t` (> now) with the figures that
    accrue over the stretch: the busy set, the run's diagnostics, the decode clocks, training's
    drain."""
    pool, mbq, drain = sim.pool, sim.mb_queue, sim._drain
    vclocks = pool.vclocks
    one = len(pool.lanes) == 1
    n_cells, reps, diag, busy = sim._n_cells, sim._reps, sim.diag, sim.busy
    knee = diag.knee

    def advance(now: float, t: float, speed: tuple, n: int, n_rollout: int, pushing: bool, left: float,
                rate: float, drains: bool) -> None:
        dt = t - now
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
    return advance


def _due(sim):
    """`handle_due() -> (handled, progressed, wake)`: everything due now: calls that ended, then
    events (most are a call's prefill or its tool time). Calls and tool time inside an execution
    change nothing a policy decides on, so only execution ends, evaluations, switches, step ends
    and ticks wake the policy."""
    pool, events = sim.pool, sim.events
    lanes, vclocks = pool.lanes, pool.vclocks
    calls0 = lanes[0]
    one = len(lanes) == 1
    end_call, decode, end_env, event = sim._end_call, pool.add, sim._end_env, sim._event

    def handle_due() -> tuple[int, bool, bool]:
        wake = False
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
        return done, progressed, wake
    return handle_due
