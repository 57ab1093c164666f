"""`gyre rollout`, the offline rollout command: run G executions per task of a suite through the proxy, evaluate, write shards.

One process plays the head on one machine: it starts M engine endpoints (``engine.backend``)
and the rollout service over them (gyre.services.rollout: router, proxy, harness pool, evaluator
pool, shard writer, the same object the head uses). Each finished execution is ended at the
proxy (its key revoked, its tree handed over), scored from its workspace off the critical path,
and written as its own small shard before it counts as done (a SIGKILL loses at most the
executions still running); the small shards are compacted at the end. Ctrl-C / SIGTERM stops the
harnesses, writes everything that was recorded (stopped executions with status ``stopped``) and
exits. ``--resume`` first reaps the engines a killed run left behind, then skips every
(task, member) whose execution already finished and reruns the others under a new attempt id
(a fresh workspace: a path is never reused); one that was stopped with recorded calls is resumed
by replay (``harness.resume``, gyre.proxy.replay).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import re
import secrets
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from gyre.config import GyreConfig, ResumeMode, default_tiny_dir, load_config
from gyre.engine.reaper import ProcessList, reap
from gyre.harness.execute import check_scorable, read_tasks, select_tasks
from gyre.harness.runner import private_dir
from gyre.harness.sandbox import Environments, SandboxConfig
from gyre.model.identity import model_identity
from gyre.model.tiny import ensure_tiny_model
from gyre.position import Position
from gyre.proxy.journal import read_journal
from gyre.proxy.replay import Replay, replayed_calls
from gyre.services.rollout import RecordError, RolloutService, harness_broke, journal_dir
from gyre.report.progress import limits_line
from gyre.traj.record import FINISHED, Status, limit_of
from gyre.traj.store import iter_executions, shard_paths

_ATTEMPT = re.compile(r"^(?P<base>.+)-a(?P<n>\d+)$")


@dataclass
class Planned:
    task: object          # gyre.harness.tasks.Task
    member: int           # index within the task's group of G executions
    attempt: int = 0
    replay: object = None  # the tree its stopped attempt recorded, or the Replay of a killed one's journal

    @property
    def base_id(self) -> str:
        return f"{self.task.name}-g{self.member}"

    @property
    def execution_id(self) -> str:
        return f"{self.base_id}-a{self.attempt}"


@dataclass
class RolloutSummary:
    executions: dict[str, int] = field(default_factory=dict)   # by status
    calls: int = 0
    tokens: int = 0
    rewards: list[float] = field(default_factory=list)
    harness_failures: int = 0  # executions whose harness failed or crashed by itself (not in rewards)
    unscorable: int = 0
    shards: list[str] = field(default_factory=list)
    skipped_resume: int = 0
    seconds: float = 0.0
    per_task: dict[str, list[float]] = field(default_factory=dict)
    official: list[float] = field(default_factory=list)  # NL2RepoBench's success_rate: unscorable/failed = 0
    official_passed: list[int] = field(default_factory=list)  # its `score`: the passed count
    by_source: dict[str, list[float]] = field(default_factory=dict)  # Gyre's rewards by source
    skipped_tasks: int = 0  # broken task folders of the suite, skipped
    sandbox: str = ""       # the host sandbox backend (bwrap | none)
    broken: str | None = None  # why the run stopped early: harnesses could not start in their sandbox
    failed: list[str] = field(default_factory=list)  # why executions could not be recorded: the run stopped
    unscorable_tasks: dict[str, str] = field(default_factory=dict)  # task -> why it cannot be scored here
    unscorable_reasons: dict[str, int] = field(default_factory=dict)  # executions by reason
    resumed: int = 0        # executions resumed by replay
    resumed_from_journal: int = 0  # of those, running when the run was killed (gyre.proxy.journal)
    replayed_calls: int = 0  # calls those answered from their recording
    diverged: int = 0       # resumed executions whose harness asked something not recorded
    reaped: dict = field(default_factory=dict)  # what a killed earlier run left running
    limits: dict[str, int] = field(default_factory=dict)  # executions stopped by a [harness] limit, by its key
    validation: dict | None = None  # the validation round's line (--validate)


def _split(execution_id: str) -> tuple[str, int]:
    m = _ATTEMPT.match(execution_id)
    return (m["base"], int(m["n"])) if m else (execution_id, 0)


def plan(tasks, group_size: int, previous: dict[str, tuple[str, int]], used: dict[str, int] | None = None,
         replays: dict[str, object] | None = None) -> tuple[list[Planned], int]:
    """Executions still to run. ``previous`` maps base id -> (last status, last attempt) in the
    shards; ``used`` base id -> highest attempt that has a workspace (a run killed before it
    recorded them), so a rerun never gets a path that exists; ``replays`` base id -> the tree a
    stopped attempt recorded."""
    todo, skipped = [], 0
    used, replays = used or {}, replays or {}
    for task in tasks:
        for g in range(group_size):
            p = Planned(task, g)
            status, attempt = previous.get(p.base_id, (None, -1))
            if status in FINISHED:
                skipped += 1
                continue
            p.attempt = max(attempt, used.get(p.base_id, -1)) + 1
            p.replay = replays.get(p.base_id)
            todo.append(p)
    return todo, skipped


def previous_executions(shard_dir: Path, replays: dict | None = None) -> dict[str, tuple[str, int]]:
    """Base id -> (status, attempt) of the latest attempt already in shards. ``replays``, if
    given, gets base id -> tree for each whose latest attempt was stopped with calls recorded."""
    seen: dict[str, tuple[str, int]] = {}
    if not shard_dir.exists():
        return seen
    for rec in iter_executions(shard_dir):
        base, n = _split(rec.execution_id)
        if base not in seen or n >= seen[base][1]:
            seen[base] = (rec.status, n)
            if replays is not None:
                if rec.status == Status.STOPPED and rec.tree.calls:
                    replays[base] = rec.tree
                else:
                    replays.pop(base, None)
    return seen


def journal_replays(directory: Path, previous: dict[str, tuple[str, int]], stopped: dict) -> dict[str, Replay]:
    """Base id -> the Replay of the journal its latest attempt left (it was running when the run
    was killed: no shard has it), for each base not finished and not stopped with a shard."""
    latest: dict[str, tuple[int, Path]] = {}
    for f in directory.glob("*.jsonl") if directory.is_dir() else ():
        base, n = _split(f.stem)
        status, attempt = previous.get(base, (None, -1))
        if status in FINISHED or base in stopped or n <= attempt:
            continue
        if base not in latest or n > latest[base][0]:
            latest[base] = (n, f)
    out = {}
    for base, (_, f) in latest.items():
        replay = Replay.from_journal(read_journal(f))
        if replay.recorded:
            out[base] = replay
    return out


def used_attempts(run_dir: Path) -> dict[str, int]:
    """Base id -> highest attempt whose workspace or log folder exists."""
    out: dict[str, int] = {}
    for sub in ("workspaces", "logs"):
        d = run_dir / sub
        for entry in (d.iterdir() if d.is_dir() else ()):
            if _ATTEMPT.match(entry.name):
                base, n = _split(entry.name)
                out[base] = max(out.get(base, -1), n)
    return out


class Rollout:
    def __init__(self, cfg: GyreConfig, *, progress: bool = True, validate: bool = False):
        """``validate``: after the executions, one validation round ([validate]) on the same engines."""
        self.cfg = cfg
        self.progress = progress
        self.validate = validate
        self.summary = RolloutSummary()
        self._stop = asyncio.Event()
        self.started = asyncio.Event()  # set once engines, router and proxy serve (tests, tooling)
        self.router = self.proxy = None

    def stop(self) -> None:
        """Stop as on SIGTERM: harnesses are ended, what was recorded is written."""
        self._stop.set()

    async def run(self, resume: bool = False) -> RolloutSummary:
        cfg, t0 = self.cfg, time.monotonic()
        suite = read_tasks(cfg)  # before anything is created: a bad suite is the user's first message
        tasks = select_tasks(suite.tasks, cfg.harness.tasks)
        self.summary.skipped_tasks = len(suite.skipped)
        envs = Environments(SandboxConfig.from_config(cfg.harness))  # one placement per task, shared
        self.summary.sandbox = envs.host_backend
        self.summary.unscorable_tasks = check_scorable(tasks, envs, cfg.harness.min_scorable_share)
        run_dir = private_dir(Path(cfg.run.dir))  # exists and is private before anything lands in it
        shard_dir = private_dir(cfg.shard_dir())
        replays: dict[str, object] = {}
        previous = previous_executions(shard_dir, replays) if resume else {}
        if not resume and (previous_executions(shard_dir) or (run_dir / "workspaces").is_dir()
                           or any((run_dir / "pids").glob("*.json"))):
            raise SystemExit(f"gyre rollout: {run_dir} already holds a run; pass --resume to continue it "
                             f"or choose another run.dir")
        if resume:  # the engines (and key files) a killed run left behind go before anything starts
            self.summary.reaped = reap(run_dir)
        if resume:  # executions that were running when the run was killed: their journals
            replays.update(journal_replays(journal_dir(cfg), previous, replays))
        if cfg.harness.resume is not ResumeMode.REPLAY:
            replays = {}
        todo, self.summary.skipped_resume = plan(tasks, cfg.harness.group_size, previous, used_attempts(run_dir),
                                                 replays)
        model_dir = Path(cfg.model.path or ensure_tiny_model(default_tiny_dir(cfg), cfg.model.tiny_family))
        service = RolloutService(cfg, envs, model_dir, model_identity(model_dir), shard_dir)
        engine_key = secrets.token_urlsafe(24)  # the job's secret: engines accept nothing else
        pids = ProcessList(run_dir, "rollout")

        from gyre.engine.launch import start_cell_engine  # loads torch: here, so `gyre rollout --help` is fast

        with contextlib.ExitStack() as stack:
            # engine.backend picks embedded engines or SGLang servers (one per endpoint, on this machine)
            stack.callback(pids.close)  # the list goes once the engines stopped (an ExitStack unwinds LIFO)
            engines = []
            for i in range(cfg.engine.endpoints):
                engines.append(stack.enter_context(start_cell_engine(cfg, model_dir, api_key=engine_key)))
                pids.add(f"engine{i}", engines[-1].pids, engines[-1].key_file)
            await service.start([e.url for e in engines], engine_key=engine_key)
            self.router, self.proxy = service.router, service.proxy
            self.started.set()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self._stop.set)
            bar = self._bar(len(todo))
            try:
                jobs = [asyncio.create_task(self._one(p, service, bar)) for p in todo]
                stopper = asyncio.create_task(self._stop.wait())
                pending = set(jobs)
                while pending and not self._stop.is_set() and not service.broken and not self.summary.failed:
                    done, pending = await asyncio.wait(pending | {stopper}, return_when=asyncio.FIRST_COMPLETED)
                    pending.discard(stopper)
                    self._failures(done - {stopper})
                if self._stop.is_set() or service.broken or self.summary.failed:
                    await service.stop_harnesses()
                if jobs:
                    await asyncio.wait(jobs)
                self._failures(jobs)
                stopper.cancel()
                if self.validate and not (self._stop.is_set() or service.broken or self.summary.failed):
                    await self._validation(service, envs, model_dir)
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)
                if bar is not None:
                    bar.close()
                await service.close()
        try:
            service.compact()  # the per-execution shards, merged
        except RecordError as e:
            self.summary.failed.append(str(e))
        self.summary.shards = [str(q) for q in shard_paths(shard_dir)]
        self.summary.seconds = time.monotonic() - t0
        self.summary.broken = service.broken
        return self.summary

    async def _validation(self, service: RolloutService, envs, model_dir: Path) -> None:
        """One validation round at version 0 through this rollout's service (gyre.services.validation)."""
        from gyre.services.validation import ValidationSpec, Validator

        spec = ValidationSpec.from_config(self.cfg)
        check_scorable(spec.tasks, envs, self.cfg.harness.min_scorable_share)
        validator = Validator(spec, service, Path(self.cfg.run.dir), identity=model_identity(model_dir))
        self.summary.validation = await validator.round(0)

    def _failures(self, jobs) -> None:
        """An execution whose task raised (e.g. its record could not be written) stops the run,
        which says why and exits non-zero: no execution vanishes from an exit-0 summary."""
        for job in jobs:
            e = None if job.cancelled() else job.exception()
            why = f"{type(e).__name__}: {e}" if e is not None else None
            if why and why not in self.summary.failed:
                self.summary.failed.append(why)
                print(f"gyre rollout: failed: {why}", file=sys.stderr, flush=True)

    async def _one(self, p: Planned, service: RolloutService, bar) -> None:
        # one query = one group of G executions
        rec = await service.execute(p.task, p.execution_id, 0, replay=p.replay)  # durable when it returns
        for f in journal_dir(self.cfg).glob(f"{p.base_id}-a*.jsonl"):  # a killed attempt's: replayed or superseded
            if _split(f.stem)[0] == p.base_id and _split(f.stem)[1] < p.attempt:
                f.unlink(missing_ok=True)
        if p.replay is not None:
            self.summary.resumed += 1
            n = replayed_calls(rec.tree)
            self.summary.replayed_calls += n
            self.summary.diverged += n < (p.replay.recorded if isinstance(p.replay, Replay) else len(p.replay.calls))
            if isinstance(p.replay, Replay):
                self.summary.resumed_from_journal += 1
        if rec.status in FINISHED:
            # the official score counts what could not be scored (no image, evaluator failure) as 0
            self.summary.official.append(rec.reward if math.isfinite(rec.reward) else 0.0)
            self.summary.official_passed.append(int(rec.passed or 0) if math.isfinite(rec.reward) else 0)
            if harness_broke(rec):  # the harness's own failure: told apart, never a reward sample
                self.summary.harness_failures += 1
            elif math.isfinite(rec.reward):
                self.summary.rewards.append(rec.reward)
                self.summary.per_task.setdefault(p.task.name, []).append(rec.reward)
                self.summary.by_source.setdefault(rec.reward_source, []).append(rec.reward)
            else:
                self.summary.unscorable += 1
                why = rec.reward_source if rec.reward_source != "unscorable" else \
                    self.summary.unscorable_tasks.get(p.task.name, "unscorable")
                self.summary.unscorable_reasons[why] = self.summary.unscorable_reasons.get(why, 0) + 1
        st = rec.tree.stats()
        self.summary.executions[rec.status] = self.summary.executions.get(rec.status, 0) + 1
        if (key := limit_of(rec.error)) is not None:
            self.summary.limits[key] = self.summary.limits.get(key, 0) + 1
        self.summary.calls += st.calls
        self.summary.tokens += st.unique_tokens
        if bar is not None:
            bar.update(1)
            bar.set_postfix(calls=self.summary.calls, reward=f"{_mean(self.summary.rewards):.3f}")

    def _bar(self, total: int):
        if not self.progress:
            return None
        from tqdm import tqdm

        return tqdm(total=total, desc="executions", unit="exec", file=sys.stderr)


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else math.nan


def print_summary(s: RolloutSummary, cfg: GyreConfig) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"gyre rollout: {cfg.run.dir}", show_header=False)
    t.add_column("what", style="bold")
    t.add_column("value")
    spread = statistics.pstdev(s.rewards) if len(s.rewards) > 1 else 0.0
    rows = [("tasks", f"{len(s.per_task)} scored, {len(s.unscorable_tasks)} unscorable here"
                      + "".join(f"\n  {name}: {why}" for name, why in sorted(s.unscorable_tasks.items())[:5])),
            ("executions", sum(s.executions.values())),
            ("by status", ", ".join(f"{k} {v}" for k, v in sorted(s.executions.items())) or "-"),
            ("calls", s.calls), ("tokens (unique)", s.tokens),
            ("official success_rate (NL2RepoBench)", f"{_mean(s.official):.3f}  (unscorable and failed count 0)"),
            ("official score: passed tests", f"{_mean(s.official_passed):.1f} per execution"),
            ("reward mean / std", f"{_mean(s.rewards):.3f} / {spread:.3f}  (scored executions only)"),
            ("harness failures", f"{s.harness_failures}  (failed or crashed by itself: not in the reward)"),
            ("reward by source", ", ".join(f"{k} {_mean(v):.3f} (n={len(v)})" for k, v in sorted(s.by_source.items())) or "-"),
            ("timeouts", s.executions.get(Status.TIMEOUT, 0)),
            ("stopped by limits", limits_line(s.limits) or "0"),
            ("unscorable", f"{s.unscorable}" + "".join(f"\n  {n} x {why}" for why, n in sorted(s.unscorable_reasons.items()))),
            ("skipped (resume)", s.skipped_resume),
            ("resumed by replay", f"{s.resumed} ({s.replayed_calls} calls replayed, {s.diverged} diverged; "
                                  f"{s.resumed_from_journal} from a killed run's journal)"),
            ("reaped (resume)", f"{len(s.reaped.get('processes', []))} engine processes, "
                                f"{len(s.reaped.get('key_files', []))} key files"),
            ("broken task folders skipped", s.skipped_tasks),
            ("sandbox", s.sandbox), ("shards", len(s.shards)), ("time", f"{s.seconds:.1f} s")]
    if s.validation:
        from gyre.services.validation import console_line

        rows.append(("validation", console_line(s.validation).removeprefix("gyre: validation ")))
    if s.failed:
        rows.append(("FAILED (not recorded; run again with --resume)", "\n".join(s.failed)))
    for k, v in rows:
        t.add_row(k, str(v))
    Console(stderr=False).print(t)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML configuration file")
    p.add_argument("--resume", action="store_true", help="continue a stopped run in the same run.dir")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--validate", action="store_true",
                   help="then one validation round ([validate]: held-out tasks, pass@1/pass@k) on the same engines")
    p.add_argument("--strict", action="store_true",
                   help="refuse a suite with a broken task folder (harness.strict_suite = true)")
    p.add_argument("overrides", nargs="*", help="section.key=value configuration overrides")


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    if args.strict:
        cfg.harness.strict_suite = True
    if args.validate:
        from gyre.services.validation import validation_tasks

        validation_tasks(cfg)  # no held-out task: said before any engine starts
    ro = Rollout(cfg, progress=not args.no_progress, validate=args.validate)
    summary = asyncio.run(ro.run(resume=args.resume))
    print_summary(summary, cfg)
    if summary.broken:
        print(f"gyre rollout: stopped: {summary.broken}", file=sys.stderr)
        return 3
    if summary.failed:
        print("gyre rollout: failed: " + "; ".join(summary.failed), file=sys.stderr)
        return 4
    return 130 if ro._stop.is_set() else 0


# ==== `gyre validate`: one validation round on a model or a run's weights, alone ==================

async def validate(cfg: GyreConfig, weights: str | None = None, version: int | None = None,
                   say=print) -> dict | None:
    """One validation round (gyre.services.validation) on engines of this machine serving the
    model (``model.path`` or the tiny model) or, with ``weights``, a run's exported weights
    (``<run.dir>/weights/v<N>``, loaded into each engine after it starts from the model). The
    round is labelled ``v<version>`` (the folder's number where it is one, else 0); results go to
    ``<run.dir>/validation.jsonl`` like a run's, so a round already finished there is not redone
    and an unfinished one keeps its finished samples."""
    from gyre.engine.launch import start_cell_engine
    from gyre.engine import backends
    from gyre.services.validation import ValidationSpec, Validator

    spec = ValidationSpec.from_config(cfg)  # before any engine: no held-out task is the first message
    envs = Environments(SandboxConfig.from_config(cfg.harness))
    check_scorable(spec.tasks, envs, cfg.harness.min_scorable_share)
    run_dir = private_dir(Path(cfg.run.dir))
    if version is None:
        pos = Position.of_name(Path(weights).name) if weights else None
        version = pos.step if pos is not None and pos.boundary else 0
    model_dir = Path(cfg.model.path or ensure_tiny_model(default_tiny_dir(cfg), cfg.model.tiny_family))
    identity = model_identity(model_dir)
    service = RolloutService(cfg, envs, model_dir, identity, private_dir(run_dir / "validation"))
    engine_key = secrets.token_urlsafe(24)
    pids = ProcessList(run_dir, "validate")
    with contextlib.ExitStack() as stack:
        stack.callback(pids.close)
        engines = []
        for i in range(cfg.engine.endpoints):
            engines.append(stack.enter_context(start_cell_engine(cfg, model_dir, api_key=engine_key)))
            pids.add(f"engine{i}", engines[-1].pids, engines[-1].key_file)
            if weights:  # exported weights carry no tokenizer: the engine boots from the model, then loads them
                backends.get(cfg.engine.backend).admin(cfg, engines[-1].url, engine_key, 120.0).load_weights(
                    str(weights), str(version))
        await service.start([e.url for e in engines], engine_key=engine_key)
        validator = Validator(spec, service, run_dir, identity=identity, say=say)
        loop = asyncio.get_running_loop()
        job = asyncio.ensure_future(validator.round(version))
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: loop.create_task(service.stop_harnesses()))
        try:
            return await job
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            await service.close()


def validate_add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML configuration file ([validate] says which tasks, n, k, sampling)")
    p.add_argument("--weights", "--checkpoint", dest="weights",
                   help="exported weights to validate (a run's weights/v<N>); default: the model itself")
    p.add_argument("--version", type=int, help="the round's label v<N> (default: from the weights folder, else 0)")
    p.add_argument("overrides", nargs="*", help="section.key=value configuration overrides, e.g. validate.samples=8")


def validate_run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    if args.weights and not (Path(args.weights) / "model.safetensors").exists() \
            and not any(Path(args.weights).glob("*.safetensors")):
        print(f"gyre validate: --weights {args.weights}: no *.safetensors there (give a run's weights/v<N>)",
              file=sys.stderr)
        return 2
    line = asyncio.run(validate(cfg, args.weights, args.version))
    if line is None:
        print("gyre validate: stopped before the round finished; run it again to finish it", file=sys.stderr)
        return 130
    return 0
