"""One run spec for both drivers: what a run's schedule is, built once from its configuration.

The live head, the simulator, `gyre plan --config` and the benchmarks all take a `RunSpec`, so
the schedule they drive cannot drift apart (ARCHITECTURE.md invariant 3): the coordinator core's
spec (steps, groups, staleness and its rule, bursts and their order, the zero-variance rule), the
scheme with its policy's parameters (cost hints, Async's rollout pool) and the off-policy
correction the trainers use, with `auto` resolved against this schedule.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from gyre.config import Advantage, GyreConfig, OffPolicyMode, Scheme, resolved_off_policy
from gyre.sched.core import Coordinator, CoreSpec
from gyre.sched.elastic import ElasticPolicy
from gyre.sched.elastic_paper import ElasticPaperPolicy
from gyre.sched.fixed import AsyncPolicy, ColocatePolicy
from gyre.sched.policy import Hints, Policy

SCHEMES = tuple(s.value for s in Scheme)


@dataclass(frozen=True)
class RunSpec:
    core: CoreSpec
    scheme: Scheme = Scheme.E
    hints: Hints = field(default_factory=Hints)
    rollout_cells: int = 1        # scheme A's rollout pool (the other schemes size their own)
    off_policy: OffPolicyMode = OffPolicyMode.TIS  # the trainers' correction, `auto` already resolved

    def __post_init__(self) -> None:
        object.__setattr__(self, "scheme", Scheme(self.scheme))
        if self.rollout_cells < 1:
            raise ValueError(f"rollout_cells must be >= 1, got {self.rollout_cells}")

    @classmethod
    def from_config(cls, cfg: GyreConfig, *, start_version: int = 0, first_group: int = 0) -> "RunSpec":
        """The run `cfg` describes; a resumed run starts at `start_version` and group id `first_group`."""
        s, t = cfg.sched, cfg.train
        off_policy = resolved_off_policy(cfg)
        core = CoreSpec(
            steps=cfg.run.steps, groups_per_step=cfg.run.groups_per_step, group_size=cfg.harness.group_size,
            staleness=s.staleness, staleness_rule=s.staleness_rule, steps_per_sync=s.steps_per_sync,
            start_version=start_version, first_group=first_group,
            # equal rewards carry no signal only for a baseline-relative advantage
            skip_zero_variance=s.skip_zero_variance and t.advantage is not Advantage.REWARD,
            max_replacements_per_step=s.max_replacements_per_step, burst_order=s.burst_order, seed=cfg.run.seed,
            # later minibatches clip (tis, decoupled) against the step's start: pi_prox, one no-grad forward
            minibatches=t.minibatches_per_step, prox=off_policy is not OffPolicyMode.NONE)
        hints = Hints(to_train_s=s.to_train_s, to_rollout_s=s.to_rollout_s, push_s=s.push_s, eval_s=s.eval_s,
                      execs_per_cell=s.execs_per_cell, min_dwell_s=s.min_dwell_s, calls_per_cell=s.calls_per_cell,
                      train_tokens_per_s=s.train_tokens_per_s)
        return cls(core, s.scheme, hints, max(1, s.rollout_cells_async), off_policy)

    @property
    def staleness(self) -> int:
        return self.core.staleness

    def replace(self, **changes) -> "RunSpec":
        """A copy with top-level fields (scheme, hints, rollout_cells, off_policy) and core fields
        (steps, staleness, ...) changed: a sweep around one run."""
        mine = {f.name for f in dataclasses.fields(self)}
        core = {k: v for k, v in changes.items() if k not in mine}
        top = {k: v for k, v in changes.items() if k in mine}
        if core:
            top["core"] = dataclasses.replace(top.get("core", self.core), **core)
        return dataclasses.replace(self, **top)

    def policy(self) -> Policy:
        """A fresh policy of this run's scheme (a policy keeps estimates: one per driver)."""
        k, h = self.core.staleness, self.hints
        if self.scheme is Scheme.E:
            return ElasticPolicy(k, h)
        if self.scheme is Scheme.E_PAPER:
            return ElasticPaperPolicy(k, h)
        if self.scheme is Scheme.A:
            return AsyncPolicy(k, h, self.rollout_cells)
        return ColocatePolicy(k, h)

    def coordinator(self, policy: Policy) -> Coordinator:
        """The coordinator core of this run, admitting in `policy`'s order."""
        return Coordinator(self.core, policy.admission_key)


def make_policy(scheme: str, staleness: int = 0, hints: Hints | None = None, rollout_cells: int = 1) -> Policy:
    """A policy outside any run (tests, the policy benchmarks): `rollout_cells` is scheme A's pool."""
    try:
        scheme = Scheme(scheme)
    except ValueError:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}") from None
    core = CoreSpec(steps=1, groups_per_step=1, group_size=1, staleness=staleness)
    return RunSpec(core, scheme, hints or Hints(), rollout_cells).policy()
