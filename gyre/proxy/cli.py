"""`gyre proxy`: serve the token-in/token-out proxy in front of one or more engine endpoints."""

from __future__ import annotations

import argparse
import asyncio
import secrets
import sys
from pathlib import Path
from typing import Callable

from gyre.config import default_tiny_dir, env, load_config
from gyre.engine.router import Router
from gyre.model.identity import model_identity
from gyre.model.tiny import ensure_tiny_model
from gyre.proxy.routes import create_app, start_site
from gyre.proxy.server import Proxy
from gyre.traj.record import ExecutionRecord
from gyre.traj.store import ShardWriter, shard_identity


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML configuration file")
    p.add_argument("--engine", action="append", required=True, metavar="URL",
                   help="engine endpoint (repeat for several); SGLang or `gyre engine`")
    p.add_argument("--model", help="model directory holding tokenizer.json (default: the embedded tiny model)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--admin-key", help="key for the admin routes (default: $GYRE_ADMIN_KEY or a new one, printed)")
    p.add_argument("--engine-api-key", help="key the engines require (default: $GYRE_ENGINE_API_KEY)")
    p.add_argument("--shard-dir", help="where POST /gyre/executions/ID/end writes the ended execution's shard "
                                       "(default: store.dir, else ./shards)")
    p.add_argument("overrides", nargs="*", help="section.key=value configuration overrides")


async def serve(args: argparse.Namespace) -> None:
    cfg = load_config(args.config, args.overrides)
    model_dir = Path(args.model or cfg.model.path or ensure_tiny_model(default_tiny_dir(cfg), cfg.model.tiny_family))
    tok_file = model_dir / "tokenizer.json"
    if not tok_file.is_file():
        print(f"gyre proxy: {tok_file} not found; --model must be a directory with the model's tokenizer.json",
              file=sys.stderr)
        raise SystemExit(2)
    admin_key = args.admin_key or env("GYRE_ADMIN_KEY") or secrets.token_urlsafe(24)
    router = Router(args.engine, api_key=args.engine_api_key or env("GYRE_ENGINE_API_KEY"),
                    timeout_s=cfg.engine.request_timeout_s, connect_retries=cfg.engine.connect_retries)
    proxy = Proxy.from_config(cfg, router, model_dir, model_identity(model_dir))
    shard_dir = Path(args.shard_dir or cfg.store.dir or "shards")
    app = create_app(proxy, admin_key=admin_key, max_body_bytes=cfg.proxy.max_body_bytes,
                     on_end=shard_sink(cfg, shard_dir, model_identity(model_dir)))
    host = args.host or cfg.proxy.host
    runner, port = await start_site(app, host, cfg.proxy.port if args.port is None else args.port)
    if not (args.admin_key or env("GYRE_ADMIN_KEY")):
        print(f"GYRE_PROXY_ADMIN_KEY {admin_key}", flush=True)
    print(f"GYRE_PROXY_LISTENING http://{host}:{port}", flush=True)
    base = f"http://{host}:{port}"
    print(f"gyre proxy: OpenAI base URL {base}/v1 (OPENAI_BASE_URL); per execution:\n"
          f"  register: curl -s -H 'Authorization: Bearer $ADMIN_KEY' -d '{{\"execution_id\": \"e1\"}}' "
          f"{base}/gyre/executions   -> its api_key (OPENAI_API_KEY)\n"
          f"  end:      curl -s -H 'Authorization: Bearer $ADMIN_KEY' -d '{{\"status\": \"done\"}}' "
          f"{base}/gyre/executions/e1/end   -> its shard in {shard_dir}\n"
          f"  (docs/harnesses.md)", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await router.close()


def shard_sink(cfg, shard_dir: Path, identity: dict) -> Callable[[ExecutionRecord], dict]:
    """What a standalone proxy does with an execution ended through its admin route: one shard of
    it in `shard_dir` (called in a worker thread: HDF5 never blocks the event loop)."""
    writer = ShardWriter.from_config(cfg.store, shard_dir, shard_identity(identity))

    def write(rec: ExecutionRecord) -> dict:
        shard_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # shards are private to the user
        return {"shard": str(writer.write([rec]).resolve())}

    return write


def run(args: argparse.Namespace) -> int:
    try:
        asyncio.run(serve(args))
    except KeyboardInterrupt:
        pass
    return 0
