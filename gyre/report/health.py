"""Health of a run, judged from each step row: the warnings a user must hear while it runs.

Each warning has a stable kind (a metric `health/<kind>` is 1 on the steps it fires, 0 otherwise)
and a message that says what is wrong and where to look. The head prints them, puts them in the
step row (`warnings` in steps.jsonl) and in the metrics streams. Reads only the row: nothing here
computes a figure the run did not record. The train/inference mismatch at lag 0 (`mismatch_lag0`)
is judged by `gyre.train.step_stats.lag0_warning`, which the head adds (report imports no trainer).
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("reward_variance_zero", "entropy_low", "replacements_exhausted", "mismatch_lag0", "clip_stuck",
         "harness_failures")
CLIP_STREAK = 3  # steps in a row with stale groups and no token clipped before "stuck at 0" is said


@dataclass(frozen=True)
class Thresholds:
    entropy_below: float = 0.05
    harness_failure_rate: float = 0.5
    max_replacements: int = 4
    skip_zero_variance: bool = True

    @classmethod
    def from_config(cls, cfg) -> "Thresholds":
        return cls(cfg.run.warn_entropy_below, cfg.run.warn_harness_failure_rate, cfg.sched.max_replacements_per_step, cfg.sched.skip_zero_variance)


class Health:
    """Stateful only for streaks (a clip fraction of 0 is normal for one step, not for many)."""

    def __init__(self, thresholds: Thresholds | None = None) -> None:
        self.th = thresholds or Thresholds()
        self._clip_zero = 0

    def check(self, row: dict) -> dict[str, str]:
        """kind -> message for each warning this step row raises."""
        th, out = self.th, {}
        std, n = row.get("reward_std"), row.get("reward_n") or 0
        if std is not None and n > 1 and std == 0.0:
            out["reward_variance_zero"] = (
                f"all {n} rewards of step {row['step'] + 1} equal {row['reward_mean']:.3g}: the step carries no "
                f"learning signal (grad norm ~0); look at the tasks' difficulty (`gyre tasks`), the reward "
                f"(eval.*) and rollout/reward_by_task")
        ent = row.get("entropy")
        if ent is not None and ent < th.entropy_below:
            out["entropy_low"] = (
                f"mean token entropy {ent:.3g} nats < run.warn_entropy_below={th.entropy_below}: the policy is "
                f"collapsing onto fixed outputs; look at train/entropy over steps, lower train.lr")
        repl = row.get("replaced_zero_variance") or 0
        if th.skip_zero_variance and th.max_replacements and repl >= th.max_replacements:
            out["replacements_exhausted"] = (
                f"{repl} zero-variance groups replaced in step {row['step'] + 1}, the most allowed "
                f"(sched.max_replacements_per_step={th.max_replacements}): most groups score alike; look at "
                f"rollout/reward_by_task for tasks that are always solved or never")
        clip = row.get("clip_frac")
        self._clip_zero = self._clip_zero + 1 if clip == 0.0 and (row.get("staleness_max") or 0) > 0 else 0
        if clip is not None and clip >= 0.99:
            out["clip_stuck"] = (
                f"clip fraction {clip:.2f}: nearly every token is clipped, the ratio is far from 1; look at "
                f"offpolicy/mismatch_k3_lag* and offpolicy/ratio_q*, lower train.lr")
        elif self._clip_zero >= CLIP_STREAK:
            out["clip_stuck"] = (
                f"clip fraction 0 for {self._clip_zero} steps although stale groups trained: the clip range "
                f"(train.clip_low/clip_high) never binds; look at offpolicy/ratio_q01 and ratio_q99")
        fail, ended = row.get("harness_failure_rate"), row.get("executions_ended") or 0
        if fail is not None and ended and fail > th.harness_failure_rate:
            out["harness_failures"] = (
                f"{fail:.0%} of the {ended} executions that ended since the last step failed or crashed "
                f"(> run.warn_harness_failure_rate={th.harness_failure_rate}); look at ledger.jsonl and the "
                f"executions' logs in the run directory")
        return out

