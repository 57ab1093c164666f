"""The rollout service: everything that runs an execution and records it.

One object holds the router over the engines that serve rollout, the OpenAI-compatible proxy in
front of it, the harness pool, the evaluator pool and the shard writer. `gyre rollout` (engines
of its own) and the head (the rollout cells' engines, which come and go) use the same object, so
an execution runs, is scored and is made durable the same way in both.
"""

from __future__ import annotations

import logging
import secrets
from pathlib import Path

from gyre.config import GyreConfig
from gyre.fsio import storage_full
from gyre.engine.router import Router
from gyre.harness.evaluator import EvaluatorPool
from gyre.harness.execute import run_and_evaluate
from gyre.harness.runner import HarnessPool
from gyre.model.tokenizer import load_tokenizer
from gyre.proxy.journal import Journal
from gyre.proxy.server import Proxy, create_app, proxy_options, start_site
from gyre.traj.store import ShardWriter, compact, shard_identity

log = logging.getLogger("gyre.rollout")
RECORD_TRIES = 3  # a transient write error (e.g. a parallel file system's hiccup) is retried this often


def journal_dir(cfg: GyreConfig) -> Path:
    """Where running executions' calls are journaled (gyre.proxy.journal)."""
    return Path(cfg.run.dir) / "journal"


class RecordError(RuntimeError):
    """An execution could not be made durable: the run must stop and say why."""


class RolloutService:
    def __init__(self, cfg: GyreConfig, envs, model_dir: str | Path, identity: dict, shard_dir: str | Path):
        self.cfg, self.envs, self.model_dir, self.identity = cfg, envs, Path(model_dir), identity
        # the writer exists before anything runs: a resumed job compacts what a crash cut short first
        self.writer = ShardWriter.from_config(cfg.store, shard_dir, shard_identity(identity))
        self.router: Router | None = None
        self.proxy: Proxy | None = None
        self.pool: HarnessPool | None = None
        self.evaluators: EvaluatorPool | None = None
        self.base_url = ""
        self._site = None

    async def start(self, endpoints, *, engine_key: str, wait_for_endpoint_s: float | None = None) -> None:
        """Router over ``endpoints``, the proxy serving on ``proxy.host:proxy.port``, the pools."""
        cfg = self.cfg
        kw = {} if wait_for_endpoint_s is None else {"wait_for_endpoint_s": wait_for_endpoint_s}
        self.router = Router(list(endpoints), api_key=engine_key, timeout_s=cfg.engine.request_timeout_s, **kw)
        self.proxy = Proxy(self.router, load_tokenizer(self.model_dir), identity=self.identity,
                           default_max_tokens=cfg.proxy.default_max_tokens, max_tokens_cap=cfg.proxy.max_tokens_cap,
                           max_executions=cfg.proxy.max_executions, max_calls_in_flight=cfg.proxy.max_calls_in_flight,
                           **proxy_options(cfg.proxy, self.model_dir))
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
    async def execute(self, task, execution_id: str, group: int, *, on_ended=None, replay=None):
        """Run one execution and score it (gyre.harness.execute); returns its ExecutionRecord."""
        return await run_and_evaluate(self.proxy, self.pool, self.evaluators, task, execution_id, group,
                                      self.base_url, on_ended=on_ended, replay=replay,
                                      infra_retries=self.cfg.harness.infra_retries)

    def record(self, records) -> None:
        """Durable when it returns (one small shard, fsynced and renamed): only then may anyone count it.
        A write that fails is retried; a full file system, or a failure that stays, raises RecordError
        with its reason: the driver stops the run loudly (never a hang, never exit 0 with work missing)."""
        records = list(records)
        ids = ", ".join(r.execution_id for r in records)
        for attempt in range(1, RECORD_TRIES + 1):
            try:
                self.writer.write(records)
                if self.proxy is not None and self.proxy.journal is not None:  # in a shard now
                    for r in records:
                        self.proxy.journal.discard(r.execution_id)
                return
            except OSError as e:
                full = storage_full(e, self.writer.dir, "store.dir")
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
