"""``gyre engine``: serve one model: the embedded engine here (SGLang's RL HTTP subset), or through the
backend table (``--backend sglang|vllm``) the servers of another engine, until stopped.

Also runnable as ``python -m gyre.engine.cli`` (what :mod:`gyre.engine.launch` starts). Prints
``GYRE_ENGINE_LISTENING http://HOST:PORT`` on stdout once it accepts requests.

The API key is on by default: without ``--api-key``/``--api-key-file`` the engine generates one
and writes it to a private (0600) file, printed as ``GYRE_ENGINE_KEY_FILE PATH`` before the
ready line (``--api-key-file PATH`` naming a file that does not exist yet gets the generated key
written there). Serving without a key needs ``--no-api-key`` and prints a warning.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import sys
from pathlib import Path

from gyre import faults
from gyre.config import ConfigError, default_tiny_dir, load_config
from gyre.engine import backends
from gyre.fsio import atomic_write_text
from gyre.model.tiny import ensure_tiny_model

KEY_FILE_MARKER = "GYRE_ENGINE_KEY_FILE"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory (transformers layout); default: model.path, "
                                                  "else the embedded tiny model (built if absent)")
    p.add_argument("--host", default=None, help="listen address (default engine.host)")
    p.add_argument("--port", type=int, default=None, help="listen port, 0 = any free port (default engine.port)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route")
    p.add_argument("--api-key-file", type=Path, default=None,
                   help="read the API key from this file (keeps it out of the process list); "
                        "a file that does not exist yet gets a generated key (0600)")
    p.add_argument("--no-api-key", action="store_true",
                   help="serve without any key (anyone who reaches the port can generate and load weights)")
    p.add_argument("--incremental-streaming-output", action="store_true",
                   help="streamed /generate chunks carry only the new tokens (SGLang's flag of the same name)")
    p.add_argument("--config", default=None, help="Gyre TOML config file")
    p.add_argument("--backend", default=None, choices=backends.NAMES,
                   help="engine.backend: embedded (serve here), sglang or vllm (start their servers and wait)")
    p.add_argument("overrides", nargs="*", help="section.key=value configuration overrides, as every gyre "
                                                "command takes them (e.g. engine.max_body_bytes=4096)")
    p.add_argument("--set", dest="set_overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help=argparse.SUPPRESS)  # the older spelling, still accepted
    p.add_argument("--weight-version", default="0", help="initial weight_version (default 0)")
    # One thread by default: the tiny model gains nothing from more, and OpenMP threads that spin
    # while another process holds a core made decode steps 30x slower on shared 2-core machines.
    p.add_argument("--prefix-cache-mb", type=int, default=256,
                   help="memory for finished requests' KV caches reused by later calls (default 256)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1; 0 = torch's default)")


def run(args: argparse.Namespace) -> int:

    backend = [f"engine.backend={args.backend}"] if getattr(args, "backend", None) else []
    cfg = load_config(args.config, [*args.set_overrides, *args.overrides, *backend])
    api_key = args.api_key
    key_file: Path | None = None
    if args.no_api_key and (args.api_key or args.api_key_file):
        print("gyre engine: --no-api-key contradicts --api-key/--api-key-file; give one of them", file=sys.stderr)
        return 2
    if args.api_key_file is not None and args.api_key_file.exists():
        try:
            api_key = args.api_key_file.read_text(encoding="utf-8").strip()
        except OSError as e:
            print(f"gyre engine: cannot read --api-key-file {args.api_key_file}: {e}", file=sys.stderr)
            return 2
        if not api_key:
            print(f"gyre engine: --api-key-file {args.api_key_file} is empty", file=sys.stderr)
            return 2
    elif args.no_api_key:
        print("gyre engine: WARNING: serving WITHOUT an API key (--no-api-key): anyone who can reach the port "
              "can generate, abort requests and replace the weights", file=sys.stderr, flush=True)
    elif not api_key:
        api_key = secrets.token_urlsafe(32)
        key_file = args.api_key_file or _default_key_file(cfg)
        try:
            _write_private(key_file, api_key)
        except OSError as e:
            print(f"gyre engine: cannot write the generated API key to {key_file}: {e}; "
                  "give --api-key-file PATH or --no-api-key", file=sys.stderr)
            return 2
    model = args.model or cfg.model.path
    if not model:

        model = ensure_tiny_model(default_tiny_dir(cfg), cfg.model.tiny_family)

    host = args.host if args.host is not None else cfg.engine.host
    port = args.port if args.port is not None else cfg.engine.port
    if not backends.get(cfg.engine.backend).serves_here:  # its own servers, started through the one seam
        from gyre.engine.launch import serve_cell_engine  # the serving stack loads only when it serves

        cfg.engine.host = host
        return serve_cell_engine(cfg, model, api_key=api_key, port=port, weight_version=args.weight_version)

    from gyre.model.families import ModelFormatError, family_of, read_config

    try:  # a missing or foreign model is told before torch loads (~2 s of CPU a start), as preflight does
        family_of(read_config(model))
    except ModelFormatError as e:
        print(f"gyre engine: cannot serve {model}: {e}", file=sys.stderr)
        return 2
    import torch

    from gyre.engine.runtime import Engine  # numpy model and aiohttp server: only when serving
    from gyre.engine.server import serve  # as above

    if args.threads > 0:
        torch.set_num_threads(args.threads)

    try:
        engine = Engine(model, weight_version=args.weight_version, max_running=cfg.engine.max_running_requests,
                        max_new_tokens_cap=cfg.engine.max_new_tokens_cap, prefix_cache_mb=args.prefix_cache_mb,
                        pace=cfg.engine.pace)
    except (ModelFormatError, OSError) as e:
        print(f"gyre engine: cannot serve {model}: {e}", file=sys.stderr)
        return 2
    if key_file is not None:
        print(f"gyre engine: no API key given; generated one in {key_file} (mode 0600). Clients send "
              "'Authorization: Bearer <key>'", file=sys.stderr, flush=True)
        print(f"{KEY_FILE_MARKER} {key_file}", flush=True)

    async def main() -> None:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        await serve(engine, host, port, api_key, cfg.engine.max_body_bytes, args.incremental_streaming_output)

    try:
        asyncio.run(main())
    except asyncio.CancelledError:
        pass
    finally:
        if key_file is not None:  # a generated key lives as long as the engine that checks it
            key_file.unlink(missing_ok=True)
    return 0


def _default_key_file(cfg) -> Path:

    return default_tiny_dir(cfg).parent / "engine-keys" / f"engine-{os.getpid()}-{secrets.token_hex(4)}.key"


def _write_private(path: Path, text: str) -> None:
    """Create ``path`` readable by its owner only (never briefly world-readable)."""

    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    atomic_write_text(path, text + "\n", mode=0o600)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gyre engine", description=__doc__.splitlines()[0])
    add_arguments(p)
    faults.hit("engine", "start")

    try:
        return run(p.parse_args(argv))
    except ConfigError as e:
        print(f"gyre engine: configuration error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    from gyre.fast_exit import exit_now

    exit_now(main())  # without the interpreter's ~1-2 s teardown (torch): see gyre/fast_exit.py
