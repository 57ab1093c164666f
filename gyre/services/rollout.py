"""The rollout service: everything that runs an execution and records it.

One object holds the router over the engines that serve rollout, the OpenAI-compatible proxy in
front of it, the harness pool, the evaluator pool and the shard writer. `gyre rollout` (engines
of its own) and the head (the rollout cells' engines, which come and go) use the same object, so
an execution runs, is scored and is made durable the same way in both: `execute` is an
execution's whole life (a key at the proxy, its harness, its evaluation, its durable record).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import sys
from pathlib import Path
from typing import Callable

from gyre import faults
from gyre.config import GyreConfig
from gyre.fsio import storage_full
from gyre.engine.router import Router
from gyre.harness.evaluator import EvaluatorPool
from gyre.harness.runner import HARNESS_BROKE, INFRA_PREFIX, HarnessPool
from gyre.proxy.journal import Journal
from gyre.proxy.routes import create_app, start_site
from gyre.proxy.server import Proxy
from gyre.traj.record import FINISHED, ExecutionRecord, Status, limit_of
from gyre.traj.store import ShardWriter, compact, shard_identity

log = logging.getLogger("gyre.rollout")
RECORD_TRIES = 3  # a transient write error (e.g. a parallel file system's hiccup) is retried this often


def journal_dir(cfg: GyreConfig) -> Path:
    """Where running executions' calls are journaled (gyre.proxy.journal)."""
    return Path(cfg.run.dir) / "journal"


def harness_broke(rec: ExecutionRecord) -> str:
    """Why ``rec`` must not train although it was scored: its harness failed or crashed by itself
    (not a [harness] limit the policy's work passed, not its time limit). Its 0 would be the
    harness's bug, not the policy's answer (a harness bug would teach the model). "" if it may train."""
    if rec.status not in (Status.FAILED, Status.CRASHED) or limit_of(rec.error):
        return ""
    detail = (rec.error or "").removeprefix(HARNESS_BROKE)
    return f"harness {rec.status}: {detail}" if detail else f"harness {rec.status}"


FAILURES_TOLD = 3  # harness failures printed on the console per service; the ledger has every one


class RecordError(RuntimeError):
    """An execution could not be made durable: the run must stop and say why."""


class RolloutService:
    def __init__(self, cfg: GyreConfig, envs, model_dir: str | Path, identity: dict, shard_dir: str | Path,
                 *, fault_scope: str = "rollout"):
        """`fault_scope`: the process named in the fault phases of an execution's end (gyre.faults)."""
        self.cfg, self.envs, self.model_dir, self.identity = cfg, envs, Path(model_dir), identity
        self.fault_scope = fault_scope
        self.failures_told = 0
        # the writer exists before anything runs: a resumed job compacts what a crash cut short first
        self.writer = ShardWriter.from_config(cfg.store, shard_dir, shard_identity(identity))
        self.router: Router | None = None
        self.proxy: Proxy | None = None
        self.pool: HarnessPool | None = None
        self.evaluators: EvaluatorPool | None = None
        self.base_url = ""
        self._site = None
        self._trying: dict[str, str] = {}  # execution id -> the id of its harness try running now
        self._ending: set[asyncio.Task] = set()  # harnesses being ended for their token budget

    async def start(self, endpoints, *, engine_key: str, wait_for_endpoint_s: float | None = None) -> None:
        """Router over ``endpoints``, the proxy serving on ``proxy.host:proxy.port``, the pools."""
        cfg = self.cfg
        kw = {} if wait_for_endpoint_s is None else {"wait_for_endpoint_s": wait_for_endpoint_s}
        self.router = Router(list(endpoints), api_key=engine_key, timeout_s=cfg.engine.request_timeout_s,
                             connect_retries=cfg.engine.connect_retries, backend=cfg.engine.backend, **kw)
        self.proxy = Proxy.from_config(cfg, self.router, self.model_dir, self.identity)
        self._site, port = await start_site(create_app(self.proxy, admin_key=secrets.token_urlsafe(24),
                                                       max_body_bytes=cfg.proxy.max_body_bytes),
                                            cfg.proxy.host, cfg.proxy.port)
        self.base_url = f"http://{cfg.proxy.host}:{port}/v1"
        self.proxy.journal = Journal(journal_dir(cfg))
        self.pool = HarnessPool.from_config(cfg, self.envs)
        self.evaluators = EvaluatorPool.from_config(cfg, self.envs)

    # ---- endpoints: the rollout cells' engines, as roles change --------------------------------
    def add_endpoint(self, url: str) -> None:
        self.router.add_endpoint(url)

    async def remove_endpoint(self, url: str) -> None:
        """Calls in flight there are aborted and retried on another endpoint."""
        await self.router.remove_endpoint(url, abort=True)

    # ---- executions ----------------------------------------------------------------------------
    async def execute(self, task, execution_id: str, group: int, *, on_ended: Callable[[str], None] | None = None,
                      on_scored: Callable[[ExecutionRecord], None] | None = None, replay=None,
                      sampling=None, writer: ShardWriter | None = None) -> ExecutionRecord:
        """One execution's life: a key at the proxy, its harness, its evaluation, its durable record.

        Returns the ExecutionRecord, on disk when this returns (status, workspace, tree and, for
        executions that ended by themselves, reward, passed/total and reward source; stopped ones say
        why they were not scored). `on_ended(status)` is called when the harness has ended, before
        the evaluation (the coordinator stops counting it as running rollout work then);
        `on_scored` as in `settle`. ``replay``: what a stopped (its tree) or killed (its journal)
        earlier run of this execution recorded (replay-resume, gyre.proxy.replay). ``sampling``:
        its own gyre.proxy.sampling.SamplingPolicy at the proxy (None: the run's); ``writer``:
        where its record goes instead of the run's shards (validation executions, never trained: gyre.services.validation).
        """
        budget = (f"token budget of {self.proxy.token_budget} sampled tokens reached "
                  f"(proxy.execution_token_budget)")
        key = self.proxy.register(execution_id, task=task.name, group=group, replay=replay, sampling=sampling,
                                  on_budget_spent=self._ender(execution_id, budget))
        try:
            status, workspace, error, own, log_dir, start_failure = await self._run_harness(task, execution_id, key)
        finally:
            self._trying.pop(execution_id, None)
        if self.proxy.budget_spent(execution_id) and status in (Status.DONE, Status.FAILED, Status.CRASHED):
            # proxy.execution_token_budget: it ended by itself once its calls were refused; scored as a timeout is
            status = Status.TIMEOUT
            error = budget + (f"; then: {error}" if error else "")
        rec = self.proxy.end(execution_id, status)
        rec.workspace, rec.error = workspace, error
        if on_ended is not None:
            on_ended(status)
        await self._evaluate(rec, task, own, log_dir, start_failure, error)
        self._tell_failure(rec)
        self.settle(rec, on_scored, writer)
        return rec

    def _ender(self, execution_id: str, why: str) -> Callable[[], None]:
        """What the proxy calls at the execution's first call refused for its token budget (from
        its own thread, if it has one): the harness try running now is ended as a timeout unless
        it ends by itself first (HarnessPool.end_as_timeout), so one that keeps calling does not
        run on to its time limit."""
        loop = asyncio.get_running_loop()

        def end() -> None:
            task = loop.create_task(self.pool.end_as_timeout(self._trying.get(execution_id, execution_id), why))
            self._ending.add(task)
            task.add_done_callback(self._ending.discard)

        return lambda: loop.call_soon_threadsafe(end)

    def _tell_failure(self, rec: ExecutionRecord) -> None:
        """A harness that broke says so on the console (the first few), with how it ended and its
        stderr's last lines: a summary reading 'failed 4, reward 0.000' alone hides the cause."""
        why = harness_broke(rec)
        if not why:
            return
        self.failures_told += 1
        if self.failures_told <= FAILURES_TOLD:
            more = "; further failures: ledger.jsonl" if self.failures_told == FAILURES_TOLD else ""
            print(f"gyre: execution {rec.execution_id} not trained: {why}{more}", file=sys.stderr, flush=True)

    def settle(self, rec: ExecutionRecord, on_scored: Callable[[ExecutionRecord], None] | None = None,
               writer: ShardWriter | None = None) -> None:
        """An ended, scored execution made durable: its record on disk first (RecordError: the run
        stops, saying why), then `on_scored(rec)` (what the driver writes down of it); only then may
        anyone count it. The fault phases `execution_ended` and `execution_recorded` sit before and
        after (gyre.faults)."""
        faults.hit(self.fault_scope, "execution_ended")
        self.record([rec], writer)
        if on_scored is not None:
            on_scored(rec)
        faults.hit(self.fault_scope, "execution_recorded")

    async def _run_harness(self, task, execution_id: str, key: str):
        """The harness, tried again alone after an infrastructure failure (its sandbox or process
        could not start: no harness ran, no call was made) up to `harness.infra_retries` times,
        each try in a fresh workspace ``<id>.retry<n>``; after that it is ``lost`` (never scored as
        a real 0). Returns (status, workspace, error, the id whose workspace may be scored, its log
        folder, whether it never started)."""
        own, tries = execution_id, []
        while True:
            start_failure, log_dir = False, ""
            self._trying[execution_id] = own  # the try a spent token budget ends (see _ender)
            try:
                result = await self.pool.run_execution(task, own, api_key=key, base_url=self.base_url)
                status, workspace, error = result.status, result.workspace, result.error
                log_dir, start_failure = result.log_dir, result.start_failure
            except RuntimeError as e:  # the pool is stopping: this execution never started
                status, workspace, error = Status.STOPPED, "", str(e)
            except Exception as e:  # e.g. a reused id whose workspace is kept: Gyre's failure, not the harness's
                status, workspace, error = Status.LOST, "", f"{type(e).__name__}: {e}"
            infra = (start_failure or (status == Status.FAILED and (error or "").startswith(INFRA_PREFIX))) \
                and not self.proxy.calls_made(execution_id)
            if infra and self.pool.broken:  # the sandbox fails again and again: the run stops
                return Status.LOST, workspace, error, own, log_dir, start_failure
            if not infra:
                return status, workspace, error, own, log_dir, start_failure
            tries.append(error)
            if len(tries) > self.cfg.harness.infra_retries:
                return Status.LOST, workspace, f"{error} (tried {len(tries)} times)", own, log_dir, start_failure
            own = f"{execution_id}.retry{len(tries)}"

    async def _evaluate(self, rec: ExecutionRecord, task, own: str, log_dir: str, start_failure: bool,
                        error: str | None) -> None:
        if start_failure:  # infrastructure, not a score: never trained
            rec.reward_source = f"not-evaluated: {rec.status}: infrastructure ({error})"
        elif rec.status in FINISHED:
            # its own workspace only: the evaluator refuses anything else (never the current directory);
            # the evaluation's log beside the harness's, under run.dir (not the system temp dir)
            ev = await self.evaluators.evaluate(task, rec.workspace, rec.status, execution_id=own,
                                                log_path=f"{log_dir}/evaluation.log" if log_dir else None,
                                                calls=rec.tree.calls)  # what a reward function sees
            rec.reward = float("nan") if ev.reward is None else float(ev.reward)
            rec.reward_source, rec.passed, rec.total = ev.source, ev.passed, ev.total
            rec.reward_parts = dict(ev.parts or {})
            if ev.source == "reward-error":  # the reward's reason, with the execution (never a silent 0)
                rec.error = f"{rec.error}; {ev.error}" if rec.error else ev.error
        else:
            rec.reward_source = f"not-evaluated: {rec.status}" + (f" ({error})" if error else "")

    def record(self, records, writer: ShardWriter | None = None) -> None:
        """Durable when it returns (one small shard, fsynced and renamed): only then may anyone count it.
        A write that fails is retried; a full file system, or a failure that stays, raises RecordError
        with its reason: the driver stops the run loudly (never a hang, never exit 0 with work missing)."""
        records = list(records)
        ids = ", ".join(r.execution_id for r in records)
        for attempt in range(1, RECORD_TRIES + 1):
            try:
                (writer or self.writer).write(records)
                if self.proxy is not None and self.proxy.journal is not None:  # in a shard now
                    for r in records:
                        self.proxy.journal.discard(r.execution_id)
                return
            except OSError as e:
                full = storage_full(e, (writer or self.writer).dir, "store.dir")
                if full or attempt == RECORD_TRIES:
                    raise RecordError(f"cannot record execution {ids}: "
                                      f"{full or f'{type(e).__name__}: {e} (tried {attempt} times)'}") from e
                log.warning("writing the shard of %s failed (%s), retrying", ids, e)
            except Exception as e:  # not the disk: the same records fail the same way again
                raise RecordError(f"cannot record execution {ids}: {type(e).__name__}: {e}") from e

    def compact(self) -> None:
        """Merge the per-execution shards (at the end, and on resume before anything runs)."""
        try:
            compact(self.writer, self.cfg.store.executions_per_shard)
        except OSError as e:  # the small shards stay: a later --resume merges them
            why = storage_full(e, self.writer.dir, "store.dir") or f"{type(e).__name__}: {e}"
            raise RecordError(f"cannot merge the shards (each execution's own shard is kept): {why}") from e

    @property
    def broken(self) -> str | None:
        """Why no harness can start any more (its sandbox fails again and again), or None."""
        return self.pool.broken if self.pool is not None else None

    async def stop_harnesses(self) -> None:
        if self.pool is not None:
            await self.pool.stop_all()

    async def close(self) -> None:
        """Evaluators finish what they hold; the proxy stops serving; the router's sessions close."""
        if self.evaluators is not None:
            self.evaluators.shutdown(wait=True)
        if self._site is not None:
            await self._site.cleanup()
            self._site = None
        if self.router is not None:
            await self.router.close()
        if self.proxy is not None:
            self.proxy.workers.close()
            if self.proxy.journal is not None:
                self.proxy.journal.close()
