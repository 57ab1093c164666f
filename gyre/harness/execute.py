"""One execution end to end, as every driver of live executions runs it (`gyre rollout`, the head).

A key at the proxy, the harness process, its recorded tree, then the evaluation of its workspace.
Here rather than in a command module so the head does not import the `gyre rollout` command.
"""

from __future__ import annotations

import logging
from typing import Callable

from gyre.config import ConfigError
from gyre.harness.tasks import read_suite
from gyre.traj.record import FINISHED, Status

log = logging.getLogger("gyre.execute")


INFRA_PREFIX = "cannot start the harness"  # the runner's error when the sandbox or process could not start


async def run_and_evaluate(proxy, pool, evaluators, task, execution_id: str, group: int, base_url: str,
                           on_ended: Callable[[str], None] | None = None, replay=None, infra_retries: int = 0):
    """Run one execution and score it.

    Returns the ExecutionRecord: status, workspace, tree and (for executions that ended by
    themselves) reward, passed/total and reward source; stopped ones say why they were not scored.
    `on_ended(status)` is called when the harness has ended, before the evaluation starts (the
    coordinator stops counting it as running rollout work then). ``replay``: the tree a stopped
    earlier run of this execution recorded (replay-resume, gyre.proxy.replay).

    An infrastructure failure (its sandbox or process could not start: no harness ran, no call
    was made) is retried, this execution alone, up to ``infra_retries`` times, each try in a
    fresh workspace ``<id>.retry<n>``; after that it is ``lost`` (never scored as a real 0).
    """
    key = proxy.register(execution_id, task=task.name, group=group, replay=replay)
    own, tries = execution_id, []  # own: the id whose workspace the evaluator may score
    while True:
        start_failure, log_dir = False, ""
        try:
            result = await pool.run_execution(task, own, api_key=key, base_url=base_url)
            status, workspace, error = result.status, result.workspace, result.error
            log_dir, start_failure = result.log_dir, result.start_failure
        except RuntimeError as e:  # the pool is stopping: this execution never started
            status, workspace, error = Status.STOPPED, "", str(e)
        except Exception as e:  # e.g. a reused id whose workspace is kept: Gyre's failure, not the harness's
            status, workspace, error = Status.LOST, "", f"{type(e).__name__}: {e}"
        infra = (start_failure or (status == Status.FAILED and (error or "").startswith(INFRA_PREFIX))) \
            and not proxy.by_id[execution_id].tree.calls
        if infra and getattr(pool, "broken", None):  # the sandbox fails again and again: the run stops
            status = Status.LOST
            break
        if not infra:
            break
        tries.append(error)
        if len(tries) > infra_retries:
            status = Status.LOST
            error = f"{error} (tried {len(tries)} times)"
            break
        own = f"{execution_id}.retry{len(tries)}"
    rec = proxy.end(execution_id, status)
    rec.workspace = workspace
    if on_ended is not None:
        on_ended(status)
    if start_failure:  # infrastructure, not a score: never trained
        rec.reward_source = f"not-evaluated: {status}: infrastructure ({error})"
    elif status in FINISHED:
        # its own workspace only: the evaluator refuses anything else (never the current directory);
        # the evaluation's log beside the harness's, under run.dir (not the system temp dir)
        ev = await evaluators.evaluate(task, workspace, status, execution_id=own,
                                       log_path=f"{log_dir}/evaluation.log" if log_dir else None)
        rec.reward = float("nan") if ev.reward is None else float(ev.reward)
        rec.reward_source, rec.passed, rec.total = ev.source, ev.passed, ev.total
    else:
        rec.reward_source = f"not-evaluated: {status}" + (f" ({error})" if error else "")
    return rec


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
    """The configured suite (``harness.suite``, ``strict_suite``, ``image_template``): the Suite
    (its tasks and the broken folders skipped). Errors are ConfigErrors naming task and file."""

    h = cfg.harness
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

