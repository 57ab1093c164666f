"""The lag of trained groups computed directly from the coordinator core's group records: an
oracle for `gyre.events.RunStats.lag`, which keeps running sums instead of the groups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from gyre.sched.core import Coordinator, GroupRecord, GroupState


@dataclass(frozen=True)
class LagStats:
    """Staleness of trained groups: group-weighted mean, token-weighted mean, worst; both units."""
    groups: int
    group_mean_steps: float
    token_mean_steps: float
    worst_steps: int
    group_mean_syncs: float
    token_mean_syncs: float
    worst_syncs: int
    tokens: float = 0.0  # the trained groups' tokens

    @staticmethod
    def of(groups: Iterable[GroupRecord]) -> "LagStats":
        gs = [g for g in groups if g.lag_steps is not None]
        if not gs:
            return LagStats(0, 0.0, 0.0, 0, 0.0, 0.0, 0)
        tok = sum(g.train_tokens for g in gs)

        def tmean(attr: str) -> float:
            if tok <= 0:
                return sum(getattr(g, attr) for g in gs) / len(gs)
            return sum(getattr(g, attr) * g.train_tokens for g in gs) / tok

        return LagStats(len(gs), sum(g.lag_steps for g in gs) / len(gs), tmean("lag_steps"),
                        max(g.lag_steps for g in gs), sum(g.lag_syncs for g in gs) / len(gs),
                        tmean("lag_syncs"), max(g.lag_syncs for g in gs), float(tok))


def lag_of(core: Coordinator) -> LagStats:
    return LagStats.of(core.groups_in(GroupState.TRAINED))
