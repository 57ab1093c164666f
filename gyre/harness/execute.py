"""The tasks a run executes: the configured suite, narrowed to `harness.tasks`, and the check
that enough of them can be scored here. (An execution's life is the rollout service's:
gyre.services.rollout.RolloutService.execute.)
"""

from __future__ import annotations

import logging

from gyre.config import ConfigError
from gyre.harness.datasets import dataset_from_config
from gyre.harness.tasks import read_suite

log = logging.getLogger("gyre.execute")


def check_scorable(tasks: list, envs, min_share: float = 0.5) -> dict[str, str]:
    """Say it before running: the tasks that cannot be scored here, name -> reason. A suite with
    no scorable task is refused (a ConfigError naming the reasons: minutes of rollouts would end
    in ``reward nan`` and nothing to train); under `min_share` scorable, a warning."""

    unscorable = {}
    for t in tasks:
        place = envs.place(t)
        if not place.scorable:
            unscorable[t.name] = place.reason or "cannot be scored here"
    if not tasks:
        raise ConfigError("harness.suite: no task to run (harness.tasks selected none)")
    reasons = "; ".join(f"{name}: {why}" for name, why in list(unscorable.items())[:5])
    more = f" (and {len(unscorable) - 5} more)" if len(unscorable) > 5 else ""
    if len(unscorable) == len(tasks):
        raise ConfigError(f"harness.suite: none of its {len(tasks)} tasks can be scored here, so nothing "
                          f"would train: {reasons}{more}. Give the task images (harness.image_dir; "
                          "`gyre tasks` prints the build command of each) or choose tasks that ship their tests")
    scorable = len(tasks) - len(unscorable)
    if scorable / len(tasks) < min_share:
        log.warning("only %d of %d tasks can be scored here (harness.min_scorable_share = %g): %s%s",
                    scorable, len(tasks), min_share, reasons, more)
    return unscorable


def read_tasks(cfg):
    """The configured suite (``harness.suite``, ``strict_suite``, ``image_template``), or the
    training rows of ``dataset.path``: the Suite (its tasks and the broken folders / refused rows
    skipped). Errors are ConfigErrors naming task and file (or line)."""

    h = cfg.harness
    if cfg.dataset.path:  # tasks as dataset rows (gyre.harness.datasets): its training split
        return dataset_from_config(cfg).suite("train")
    return read_suite(h.suite, strict=h.strict_suite, image_template=h.image_template)


def load_tasks(cfg) -> list:
    """The configured suite's tasks, narrowed to ``harness.tasks``."""
    return select_tasks(read_tasks(cfg).tasks, cfg.harness.tasks)


def select_tasks(tasks: list, names: list[str]) -> list:
    """The suite's tasks named in `harness.tasks` (all when empty); unknown names are an error."""
    if not names:
        return tasks
    known = {t.name for t in tasks}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"harness.tasks: {unknown} not in the suite; available: {', '.join(sorted(known))}")
    return [t for t in tasks if t.name in names]

