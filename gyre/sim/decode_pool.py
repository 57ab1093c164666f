"""The simulator's decode pool: the calls in flight, decoding as a fluid over the serving replicas.

Every call in flight gains ``ClusterModel.token_rate(calls in flight, serving cells, their mean
context)`` tokens per second, tracked with one virtual clock in tokens so a change of load costs
O(1) instead of touching every call: a call is a heap entry (the virtual clock at which its
output is decoded, a sequence number, its execution). With the router's spread
(SimSpec.router_spread) the pool is one lane per endpoint share, each 1/L of the serving
replicas, with its own clock and heap, loaded by its own calls.

The run loop (gyre.sim.run_loop) reads the clocks, heaps and counts directly and keeps its own
copy of the speed's cache; the simulator adds a call when its prefill is done and removes it at
its end.
"""

from __future__ import annotations

from heapq import heappush
from typing import Callable


class DecodePool:
    """Lanes (one without a router spread), their virtual clocks and heaps of calls, the calls in
    flight and their context, per lane and in all."""
    # slots: read at every event, as the simulator's own are
    __slots__ = ("rate", "seq", "share", "running", "calls", "ctx", "vclocks", "lanes", "in_call", "ctx_sum",
                 "speed_key", "speed_v")

    def __init__(self, rate: Callable, spread: tuple, seq) -> None:
        """`rate`: ClusterModel.token_rate_fn(); `spread`: the router's shares (() = one lane);
        `seq`: the simulator's sequence counter (a call's heap entry draws from it)."""
        spread = spread or (1.0,)
        self.rate, self.seq = rate, seq
        self.share = tuple(x / sum(spread) for x in spread)
        self.running = [0] * len(spread)  # running executions per lane
        self.calls = [0] * len(spread)    # calls decoding per lane
        self.ctx = [0.0] * len(spread)    # their mean-context numerator
        self.vclocks = [0.0] * len(spread)
        self.lanes: list[list] = [[] for _ in spread]
        self.in_call = 0            # calls decoding in all
        self.ctx_sum = 0.0          # mean-context numerator of the calls in flight
        self.speed_key: tuple = ()  # (calls in flight, serving cells, context sum) of speed_v
        self.speed_v: tuple = (0.0,) * len(self.lanes)

    def speed(self, serving: int) -> tuple:
        """Tokens per second each call in flight gains now, per lane (kept until the load, the
        serving cells or the mean context change). The run loop keeps its own copy of this cache;
        this one serves the rarer askers (an evicted cell's re-prefill)."""
        n, cs = self.in_call, self.ctx_sum
        key = (n, serving, cs) if len(self.lanes) == 1 else (n, serving, cs, tuple(self.calls))
        if key != self.speed_key:
            self.speed_key = key
            self.speed_v = (self.rate(n, serving, cs / n if n else 0.0),) if len(self.lanes) == 1 else \
                self.lane_speeds(serving)
        return self.speed_v

    def lane_speeds(self, serving: int) -> tuple:
        """Per lane (SimSpec.router_spread): a lane is 1/L of the serving replicas, loaded by its
        own calls in flight."""
        lanes, rate = len(self.lanes), self.rate
        return tuple(rate(k * lanes, serving, c / k) if k else 0.0 for k, c in zip(self.calls, self.ctx))

    def assign_lane(self, e) -> None:
        """The lane furthest below its share of the running executions (the lowest index among
        equals): over a run the lanes carry the router's measured spread."""
        run, share = self.running, self.share
        total = sum(run) + 1
        e.lane = max(range(len(run)), key=lambda i: (share[i] * total - run[i], -i))
        run[e.lane] += 1

    def add(self, e) -> None:
        """Its prefill done, a call of `e` decodes its output in its lane."""
        self.ctx_sum += e.ctx_mid
        self.in_call += 1
        self.calls[e.lane] += 1
        self.ctx[e.lane] += e.ctx_mid
        e.call_seq = sq = next(self.seq)  # identifies its entry in the decode heap
        heappush(self.lanes[e.lane], (self.vclocks[e.lane] + e.out_seg, sq, e))

    def remove(self, e) -> None:
        """The call of `e` has been decoded (its heap entry is gone)."""
        self.in_call -= 1
        if self.in_call:
            cs = self.ctx_sum - e.ctx_mid
            self.ctx_sum = cs if cs > 0.0 else 0.0  # max(0.0, ...): float residue
        else:
            self.ctx_sum = 0.0
        lane = e.lane
        k = self.calls[lane] = self.calls[lane] - 1
        if k:
            x = self.ctx[lane] - e.ctx_mid
            self.ctx[lane] = x if x > 0.0 else 0.0  # max(0.0, x)
        else:
            self.ctx[lane] = 0.0
