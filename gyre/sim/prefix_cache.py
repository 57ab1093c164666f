"""The simulator's KV/prefix cache: where each running execution is homed and what of its context
its home cell still holds.

Each running execution is homed on one rollout cell (the router's choice: the least-loaded settled
rollout cell, the lowest index among equals); the KV of its context stays there between its calls
while the cell's capacity (replicas x HBM left after weights) allows. When it overflows, the least
recently used idle executions lose their prefix (an eviction) and their next call re-prefills the
whole context; a cell leaving rollout loses all of its prefixes and its executions move on.

The simulator (gyre.sim.simulator) asks it at a call's start (`call_begins`: the prefill the call
pays), at an execution's end (`unhome`), when a cell becomes a rollout cell again (`home`) and when
one leaves rollout (`evict`); it prices the calls in flight an eviction retries itself, since
they sit in its decode pool.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Callable

from gyre.sched.state import Role


class PrefixCache:
    """Homes, KV held per cell, LRU order of the executions holding a prefix; evictions and
    re-prefills counted (SimResult.evictions, .reprefills)."""
    # slots: asked at every call's start, as the simulator's own are
    __slots__ = ("role", "prefill", "homed", "n_homed", "lru", "kv_used", "kv_cap", "_rollout_ids",
                 "evictions", "reprefills")

    def __init__(self, role: list, kv_cap: float, prefill: Callable) -> None:
        """`role`: the simulator's list of cell roles (the same list, read here; `roles_changed`
        is called when it changes); `prefill`: ReplicaModel.prefill_fn()."""
        n = len(role)
        self.role, self.kv_cap, self.prefill = role, kv_cap, prefill
        self.homed: list[dict] = [{} for _ in range(n)]  # per cell: the executions it serves
        self.n_homed = [0] * n     # their number (the router's load)
        self._rollout_ids: list[int] | None = None  # the settled rollout cells in order; None: to list
        self.lru: list[OrderedDict] = [OrderedDict() for _ in range(n)]  # per cell: those holding a prefix
        self.kv_used = [0.0] * n   # tokens of KV held per cell
        self.evictions = 0         # prefixes evicted for capacity
        self.reprefills = 0        # calls that re-prefilled a lost context (eviction or cell switch)

    def roles_changed(self) -> None:
        self._rollout_ids = None

    def rollout_cells(self) -> list[int]:
        """The settled rollout cells, in index order (kept until a role changes)."""
        if self._rollout_ids is None:
            self._rollout_ids = [i for i, r in enumerate(self.role) if r is Role.ROLLOUT]
        return self._rollout_ids

    def call_begins(self, e, before: float, after: float) -> float:
        """A call of `e` starts with `before` tokens of context and ends with `after`: the
        seconds its prefill takes (its new tokens, and its whole context if its prefix is gone);
        its home cell now holds its context to `after`."""
        if e.cached <= 0:  # nothing cached to lose: the router sends it to the least-loaded cell
            self.unhome(e)
            self.home(e)
        prefill = self.prefill(e.pre_seg, before)
        cached = e.cached
        if e.seg > 0 and cached < before - 1e-6:  # its prefix was evicted or never rebuilt here
            prefill += self.prefill(before - cached, cached)
            self.reprefills += 1
        h = e.home
        if h >= 0:
            kv = self.kv_used
            kv[h] += after - cached
            e.cached = after
            lru = self.lru[h]
            lru[e.id] = e
            lru.move_to_end(e.id)
            if kv[h] > self.kv_cap:
                self.make_room(h)
        return prefill

    def make_room(self, cell: int) -> None:
        """LRU eviction of idle executions' prefixes until the cell's KV fits; calls in flight
        keep theirs (SGLang's radix cache never evicts a running request's KV)."""
        lru = self.lru[cell]
        while lru and self.kv_used[cell] > self.kv_cap:
            eid, x = next(iter(lru.items()))
            if x.in_call:  # the oldest holder is decoding: nothing idle is older; stop here
                break
            del lru[eid]  # an execution without a prefix is back in the order at its next call
            self.kv_used[cell] -= x.cached
            x.cached = 0.0
            self.evictions += 1

    def home(self, e) -> None:
        """Place an execution on the least-loaded settled rollout cell (the router's choice; the
        lowest index among equals)."""
        ids, n_homed = self.rollout_cells(), self.n_homed
        # min() keeps the first of equals: the lowest index, as a scan in cell order would
        best = min(ids, key=n_homed.__getitem__) if ids else -1
        e.home = best
        e.cached = 0.0
        if best >= 0:
            h = self.homed[best]
            h[e.id] = e
            n_homed[best] = len(h)

    def unhome(self, e) -> None:
        if e.home >= 0:
            h = self.homed[e.home]
            h.pop(e.id, None)
            self.n_homed[e.home] = len(h)
            self.kv_used[e.home] -= e.cached
            self.lru[e.home].pop(e.id, None)
        e.home = -1
        e.cached = 0.0

    def evict(self, cell: int) -> list:
        """A cell leaves rollout: its executions keep their harness state but lose their KV cache;
        they move to other cells (or wait, if none serves). Returns them, in their order there
        (the simulator retries their calls in flight, `rebuilt` for each that rebuilt its
        context on its new cell)."""
        homed = list(self.homed[cell].values())
        self.homed[cell] = {}
        self.n_homed[cell] = 0
        self.kv_used[cell] = 0.0
        self.lru[cell].clear()
        # each execution goes where `home` would put it, one after another: the least-loaded
        # rollout cell, the lowest index among equals (a heap of (homed, index), not a scan each)
        n_homed, homes = self.n_homed, self.homed
        least = [(n_homed[i], i) for i in self.rollout_cells()]
        heapq.heapify(least)
        for e in homed:
            if least:
                best = least[0][1]
                h = homes[best]
                h[e.id] = e
                n_homed[best] = len(h)
                heapq.heapreplace(least, (len(h), best))
            else:
                best = -1
            e.home = best
            e.cached = 0.0
        return homed

    def rebuilt(self, e, tokens: float) -> None:
        """The retried call of `e` re-prefilled its context on its new cell (if it has one)."""
        self.reprefills += 1
        if e.home >= 0:
            e.cached = tokens
            self.kv_used[e.home] += tokens
