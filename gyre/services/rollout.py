"""The rollout service: everything that runs an execution and records it.

One object holds the router over the engines that serve rollout, the OpenAI-compatible proxy in
front of it, the harness pool, the evaluator pool and the shard writer. `gyre rollout` (engines
of its own) and the head (the rollout cells' engines, which come and go) use the same object, so
an execution runs, is scored and is made durable the same way in both.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from gyre.config import GyreConfig
from gyre.engine.router import Router
from gyre.harness.evaluator import EvaluatorPool
from gyre.harness.execute import run_and_evaluate
from gyre.harness.runner import HarnessPool
from gyre.model.tokenizer import load_tokenizer
from gyre.proxy.server import Proxy, create_app, proxy_options, routing_options, start_site
from gyre.traj.store import ShardWriter, compact, shard_identity


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
                           max_executions=cfg.proxy.max_executions, **proxy_options(cfg.proxy, self.model_dir),
                           **routing_options(cfg.train, self.model_dir))
        self._site, port = await start_site(create_app(self.proxy, admin_key=secrets.token_urlsafe(24),
                                                       max_body_bytes=cfg.proxy.max_body_bytes),
                                            cfg.proxy.host, cfg.proxy.port)
        self.base_url = f"http://{cfg.proxy.host}:{port}/v1"
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
        """Durable when it returns (one small shard, fsynced and renamed): only then may anyone count it."""
        self.writer.write(list(records))

    def compact(self) -> None:
        """Merge the per-execution shards (at the end, and on resume before anything runs)."""
        compact(self.writer, self.cfg.store.executions_per_shard)

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
