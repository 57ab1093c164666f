"""Validation rounds: held-out tasks, n samples each, pass@1 / pass@k and mean reward, never trained.

A round runs ``validate.samples`` executions of each held-out task (``validate.suite``, or the
dataset's validation split) through the same rollout service as training executions (router,
proxy, harness pool, evaluator, your reward), with three differences:

- its sampling parameters (``validate.temperature``, ``validate.top_p``) are imposed at the proxy
  on every call, whatever the harness sends;
- its records go to their own shards (``<run.dir>/validation/shards``), never the run's: the
  coordinator core never hears of them, so they are never admitted or trained;
- the head shows them to the scheduling policy as running rollout executions (``views``: the
  ClusterState's ``running`` gets them), so a demand-sized policy keeps rollout cells serving
  them and the rollout capacity they take is accounted for.

When (under `gyre run`): a round is labelled by the version the rollout cells serve when it
starts (``v<N>``): at the start (``validate.at_start``), at every committed version that is a
multiple of ``validate.every_steps`` once the rollout cells serve it, and after the last step
(``validate.at_end``, on a cell switched back to rollout if none serves). Rounds run beside the
training executions, not instead of them: training never waits for a round, and a round waits only
for rollout capacity. One round runs at a time; the line of each round records the versions that
actually served its calls (``versions_served``: with steps_per_sync = 1 a push can land mid-round).

Durability (a preempted run does not redo finished work): each finished validation execution is
one line of ``<run.dir>/validation.jsonl`` before it counts, and a finished round one more line.
A resumed run skips finished rounds and, in an unfinished one, the samples already recorded.

pass@k is Chen et al. (2021)'s unbiased estimator 1 - C(n-c, k) / C(n, k) per task (n samples,
c of them passing, i.e. reward >= ``validate.pass_threshold``), averaged over tasks. An execution
that could not be scored (its reward failed, the task is unscorable here) counts as not passing and
is left out of the mean reward; the round says how many there were (``unscored``).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from dataclasses import dataclass
from math import comb
from pathlib import Path
from typing import Callable

from gyre.config import ConfigError
from gyre.harness.datasets import dataset_from_config
from gyre.harness.execute import select_tasks
from gyre.harness.runner import private_dir, workspace_path
from gyre.harness.tasks import read_suite
from gyre.position import Position
from gyre.proxy.sampling import SamplingPolicy
from gyre.sched.state import ExecView
from gyre.traj.record import FINISHED
from gyre.traj.store import ShardWriter, shard_identity

LOG = "validation.jsonl"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. 2021: the chance that at least one of k samples drawn without replacement from
    n (c of them correct) is correct, 1 - C(n-c, k) / C(n, k)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def validation_tasks(cfg) -> list:
    """The held-out tasks: ``validate.suite`` (narrowed to ``validate.tasks``), else the dataset's
    validation split. A ConfigError when there are none."""
    v = cfg.validate
    if v.suite:
        tasks = read_suite(v.suite, strict=cfg.harness.strict_suite, image_template=cfg.harness.image_template).tasks
    elif cfg.dataset.path:
        tasks = dataset_from_config(cfg).validation
    else:
        tasks = []
    if not tasks:
        raise ConfigError("validation has no task: set validate.suite (e.g. \"learnable\" or a folder) or hold out "
                          "dataset rows (dataset.validation_share, or rows with split = \"validation\")")
    try:
        return select_tasks(tasks, v.tasks)
    except ConfigError as e:
        raise ConfigError(str(e).replace("harness.tasks", "validate.tasks")) from None


def summarize(label: str, version: int, results: list[dict], samples: int, k: int, threshold: float) -> dict:
    """The round's line: pass@1, pass@k and mean reward per task and overall, the mean of each
    reward part, how many samples could not be scored."""
    per_task: dict[str, dict] = {}
    by_task: dict[str, list[dict]] = {}
    for r in results:
        by_task.setdefault(r["task"], []).append(r)
    parts: dict[str, list[float]] = {}
    for task, rs in sorted(by_task.items()):
        n = len(rs)
        scored = [r["reward"] for r in rs if r["reward"] is not None]
        c = sum(1 for x in scored if x >= threshold)
        kk = min(k, n)
        per_task[task] = {"n": n, "passed": c, "pass@1": pass_at_k(n, c, 1), f"pass@{k}": pass_at_k(n, c, kk),
                          "reward_mean": sum(scored) / len(scored) if scored else None}
        for r in rs:
            for name, x in (r.get("parts") or {}).items():
                parts.setdefault(name, []).append(x)
    rewards = [r["reward"] for r in results if r["reward"] is not None]
    mean = lambda key: sum(t[key] for t in per_task.values()) / len(per_task) if per_task else None  # noqa: E731
    versions = [r["version"] for r in results if r.get("version", -1) >= 0]
    return {"kind": "round", "round": label, "version": version, "tasks": len(per_task), "samples": samples, "k": k,
            "pass@1": mean("pass@1"), "pass@k": mean(f"pass@{k}"),
            "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "unscored": sum(r["reward"] is None for r in results), "executions": len(results),
            "parts": {name: sum(xs) / len(xs) for name, xs in sorted(parts.items())},
            "versions_served": [min(versions), max(versions)] if versions else None, "per_task": per_task}


def scalars(round_line: dict) -> dict[str, float]:
    """The round as metrics: val/pass@1, val/pass@k, val/reward_mean, val/reward/<part>,
    val/<task>/pass@1 ... (what every metrics stream gets)."""
    out = {"val/pass@1": round_line["pass@1"], "val/pass@k": round_line["pass@k"], "val/k": round_line["k"],
           "val/reward_mean": round_line["reward_mean"], "val/unscored": round_line["unscored"]}
    out.update({f"val/reward/{name}": x for name, x in round_line["parts"].items()})
    for task, t in round_line["per_task"].items():
        out.update({f"val/{task}/{key}": t[key] for key in ("pass@1", f"pass@{round_line['k']}", "reward_mean")})
    return {k: float(v) for k, v in out.items() if v is not None}


def console_line(r: dict) -> str:
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    parts = "".join(f", {k} {v:.3f}" for k, v in r["parts"].items())
    return (f"gyre: validation {r['round']}: pass@1 {fmt(r['pass@1'])}, pass@{r['k']} {fmt(r['pass@k'])}, "
            f"reward {fmt(r['reward_mean'])}{parts} ({r['tasks']} tasks x {r['samples']}"
            + (f", {r['unscored']} not scored" if r["unscored"] else "") + ")")


@dataclass
class ValidationSpec:
    tasks: list
    samples: int
    k: int
    threshold: float
    sampling: SamplingPolicy
    every_steps: int
    at_start: bool
    at_end: bool

    @classmethod
    def from_config(cls, cfg, tasks: list | None = None) -> "ValidationSpec":
        v = cfg.validate
        return cls(tasks if tasks is not None else validation_tasks(cfg), v.samples, v.k, v.pass_threshold,
                   SamplingPolicy("fix", v.temperature, v.top_p), v.every_steps, v.at_start, v.at_end)


class ValidationLog:
    """``<run.dir>/validation.jsonl``: a line per finished validation execution, one per round."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOG
        self.rounds: dict[str, dict] = {}
        self.done: dict[str, list[dict]] = {}
        if self.path.exists():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    x = json.loads(line)
                except json.JSONDecodeError:  # a line a kill cut short: its execution is redone
                    continue
                if x.get("kind") == "round":
                    self.rounds[x["round"]] = x
                elif x.get("kind") == "execution":
                    self.done.setdefault(x["round"], []).append(x)

    def append(self, line: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if line["kind"] == "round":
            self.rounds[line["round"]] = line
        else:
            self.done.setdefault(line["round"], []).append(line)


class Validator:
    """Runs rounds through a RolloutService; ``views`` shows its running executions to the policy."""

    def __init__(self, spec: ValidationSpec, service, run_dir: str | Path, *, identity: dict | None = None,
                 clock: Callable[[], float] = time.time, say: Callable[[str], None] = print):
        self.spec, self.service, self.run_dir, self.clock, self.say = spec, service, Path(run_dir), clock, say
        self.log = ValidationLog(self.run_dir)
        shard_dir = private_dir(private_dir(self.run_dir / "validation") / "shards")
        self.writer = ShardWriter.from_config(service.cfg.store, shard_dir,
                                              shard_identity(identity or getattr(service, "identity", {}) or {}))
        self.running: dict[str, tuple[int, float, int]] = {}  # execution id -> (view id, started, version)
        self._ids = 0
        self.task: asyncio.Task | None = None   # the round in flight (the head keeps one at a time)
        self._skipped: set[int] = set()

    @staticmethod
    def label(version: int) -> str:
        return str(Position(version))  # a round is named as the weights it served

    def finished(self, version: int) -> bool:
        return self.label(version) in self.log.rounds

    def due(self, version: int, start_version: int) -> bool:
        """Whether a round at ``version`` is owed: at the start, every `every_steps` after it."""
        s = self.spec
        if self.finished(version) or (self.task is not None and not self.task.done()):
            return False
        if version == start_version:
            return s.at_start
        return s.every_steps > 0 and version % s.every_steps == 0

    def busy_at(self, version: int, start_version: int) -> bool:
        """A round owed at ``version`` waits because the previous one still runs (True once per
        version: the head says so). It starts when that one ends, unless the version moved on
        first; then the next owed version gets the next round."""
        s = self.spec
        owed = version != start_version and s.every_steps > 0 and version % s.every_steps == 0
        if not owed or self.finished(version) or self.task is None or self.task.done() or version in self._skipped:
            return False
        self._skipped.add(version)
        return True

    def views(self) -> tuple[ExecView, ...]:
        """Its running executions as the policy sees running rollout work (negative ids, group -1)."""
        return tuple(ExecView(vid, -1, version, t) for vid, t, version in self.running.values())

    async def round(self, version: int) -> dict | None:
        """One round at ``version`` (the weights the rollout endpoints serve): its line, also in the
        log; None when its executions were stopped (what finished is kept for the resumed run)."""
        label = self.label(version)
        if label in self.log.rounds:
            return self.log.rounds[label]
        have = {(r["task"], r["sample"]) for r in self.log.done.get(label, [])}
        todo = [(t, i) for t in self.spec.tasks for i in range(self.spec.samples) if (t.name, i) not in have]
        results = await asyncio.gather(*(self._one(label, version, t, i) for t, i in todo))
        if any(r is None for r in results):  # stopped (preemption, the run's end): finished on resume
            return None
        line = summarize(label, version, self.log.done.get(label, []), self.spec.samples, self.spec.k,
                         self.spec.threshold)
        line["t"] = self.clock()
        self.log.append(line)
        self.say(console_line(line))
        return line

    def _fresh_id(self, label: str, task: str, sample: int) -> str:
        base = f"val{label[1:]}-{task}-s{sample}"
        eid, n = base, 0
        while workspace_path(self.run_dir, eid).exists() or (self.run_dir / "logs" / eid).exists():
            n += 1  # a killed run's attempt: a workspace is never reused
            eid = f"{base}-r{n}"
        return eid

    async def _one(self, label: str, version: int, task, sample: int) -> dict | None:
        eid = self._fresh_id(label, task.name, sample)
        self._ids += 1
        self.running[eid] = (-self._ids, self.clock(), version)
        try:
            rec = await self.service.execute(task, eid, version, sampling=self.spec.sampling, writer=self.writer,
                                             on_ended=lambda _s: self.running.pop(eid, None))
        finally:
            self.running.pop(eid, None)
        if rec.status not in FINISHED:
            return None
        reward = rec.reward if math.isfinite(rec.reward) else None
        line = {"kind": "execution", "round": label, "task": task.name, "sample": sample, "execution": eid,
                "status": str(rec.status), "reward": reward, "source": rec.reward_source, "passed": rec.passed,
                "total": rec.total, "parts": rec.reward_parts or {}, "version": rec.min_version,
                "error": rec.error if reward is None else None}
        self.log.append(line)
        return line
