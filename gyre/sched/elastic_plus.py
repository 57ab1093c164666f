"""Improved elastic (E+): the paper's elastic scheme with three changes.

1. Remaining-work estimate: instead of a fixed executions-per-cell rule, it predicts when the
   slowest running execution ends (lognormal residual life given its elapsed time) and, from the
   calls in flight, how that changes with the number of rollout cells (calls slow down as the
   load per cell grows).
2. Switch timing: it picks the rollout size that minimises the predicted end of the open step
   (rollout tail, then training of what remains on every cell), but gives training no more cells
   than the work admitted *now* keeps busy; cells move when the work exists, not before. A layout
   change that gains less than a round trip of switch costs (or 2% of the predicted time left)
   is not made, so it does not thrash.
3. Admission order: oldest policy version first, so fewer groups expire under a staleness bound.
"""

from __future__ import annotations

import heapq
import math
from statistics import NormalDist

from gyre.sched.admission import oldest_version_key
from gyre.sched.elastic import ElasticPolicy
from gyre.sched.policy import heading_counts
from gyre.sched.state import ClusterState, Role

_N = NormalDist()
_PROBE = 8  # oldest and youngest executions probed for the slowest remaining one


class ElasticPlusPolicy(ElasticPolicy):
    scheme = "E+"
    admission_key = staticmethod(oldest_version_key)
    # A cell moves to training only with at least this much admitted work per cell ahead of it.
    work_floor_s: float = 120.0
    # ... and a layout change must shorten the predicted step by this share of what is left.
    gain_share: float = 0.02

    @property
    def label(self) -> str:
        return f"E{self.staleness}+"

    @property
    def dwell_s(self) -> float:
        return 0.0  # thrashing is prevented by the predicted-gain threshold instead

    def _slowest_remaining(self, state: ClusterState, now: float, starting: int) -> float:
        """Predicted seconds (at reference load) until the last running/starting execution ends."""
        h = self.hints
        n = len(state.running) + starting * state.group_size
        if n == 0:
            return 0.0
        sig = max(h.duration_sigma, 1e-6)
        mu = math.log(h.mean_duration_s) - sig ** 2 / 2
        q = 0.5 / n  # survival level at which the slowest of n is expected to end

        def residual(elapsed: float) -> float:
            a = max(elapsed, 1.0)
            surv = _N.cdf(-(math.log(a) - mu) / sig)
            p = min(max(surv * q, 1e-12), 1 - 1e-12)
            return max(0.0, math.exp(mu + sig * _N.inv_cdf(1 - p)) - a)

        ages = [now - e.started_at for e in state.running]
        probe = heapq.nlargest(_PROBE, ages) + heapq.nsmallest(_PROBE, ages)
        if starting:
            probe.append(0.0)
        return max(residual(a) for a in probe)

    def _stretch(self, calls: float, rollout_cells: int) -> float:
        """Wall time per reference-second of execution with this many rollout cells."""
        h = self.hints
        load = max(calls / (rollout_cells * h.cell_scale), 1.0)
        speed = (h.ref_load + h.half_load) / (load + h.half_load)
        return h.model_share / speed + (1.0 - h.model_share)

    def predicted_end(self, rollout_cells: int, live: int, rem_ref: float, calls: float,
                      admitted: float, coming: float, group_tokens: float) -> float:
        """Predicted seconds to the end of the open step with this many rollout cells: the
        rollout tail, then whatever training is left on every cell. While the tail runs the
        trainers can only train what is admitted now and what arrives (on average halfway)."""
        h = self.hints
        rate = h.train_tokens_per_s * h.cell_scale
        tail = rem_ref * self._stretch(calls, rollout_cells) if rem_ref > 0 else 0.0
        trainers = live - rollout_cells
        before = min(trainers * rate * max(0.0, tail - h.to_train_s), admitted + coming / 2)
        after = max(group_tokens if rem_ref > 0 else 0.0, admitted + coming - before)
        return tail + (h.eval_s if rem_ref > 0 else 0.0) + after / (live * rate)

    def rollout_target(self, state: ClusterState, now: float, starting: int) -> int:
        h = self.hints
        live = sum(1 for c in state.cells if c.role is not Role.FAILED)
        r, _ = heading_counts(state.cells)
        n_exec = len(state.running) + starting * state.group_size
        if n_exec == 0:
            return 0 if state.train_tokens_left > 0 else r
        rem = self._slowest_remaining(state, now, starting)
        # Calls in flight now, plus those the starting groups will open.
        calls = sum(1 for e in state.running if e.in_call) + starting * state.group_size
        coming = n_exec * h.train_tokens_per_exec
        group_tokens = state.group_size * h.train_tokens_per_exec
        ends = {n: self.predicted_end(n, live, rem, calls, state.train_tokens_left, coming, group_tokens)
                for n in range(1, live + 1)}
        best = min(ends, key=lambda n: (ends[n], n))
        # Trainers only help while admitted work exists: give training no more cells than the
        # work admitted now keeps busy for work_floor_s (more cells follow as more work arrives);
        # the rest keep decoding, which shortens the tail.
        rate = h.train_tokens_per_s * h.cell_scale
        useful = int(state.train_tokens_left // (rate * self.work_floor_s))
        target = min(live, max(best, live - useful))
        keep = min(max(r, 1), live)
        # Unless no cell heads for rollout (service comes first), a layout change must gain more
        # than a round trip of switches and gain_share of the predicted time left (no thrashing).
        if r >= 1 and target != keep and ends[keep] - ends[target] <= max(
                h.to_train_s + h.to_rollout_s, self.gain_share * ends[keep]):
            return keep
        return target
