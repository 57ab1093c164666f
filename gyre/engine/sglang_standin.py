"""An SGLang stand-in for machines without GPUs: ``python -m gyre.engine.sglang_standin`` takes the
command line of ``python -m sglang.launch_server`` and serves with the embedded engine.

Set ``engine.backend = "sglang"`` and ``engine.sglang_launcher = "gyre.engine.sglang_standin"`` and
the whole SGLang path of Gyre (launch over a cell's nodes, wait for ``/health``, release/resume,
weight loads, aborts, drains) runs on CPU exactly as it would against SGLang, through the same
command lines and the same HTTP routes.

Flags. Every option string is first matched against SGLang 0.5.23's own list
(:mod:`gyre.engine.sglang_flags`), with argparse's unique-prefix rule, so a name SGLang would reject
is rejected here too (and ``--tp`` is ``--tp-size`` as in SGLang). Of SGLang's flags, those in
:data:`HONOURED` are modelled and :data:`ACCEPTED_IGNORED` only concern GPUs or logs; any other real
SGLang flag is refused with a message saying the stand-in does not model it, since silently
ignoring it would make a test pass that the real server could fail.

Nodes. ``--nnodes N --node-rank R --dist-init-addr HOST:PORT`` mirror SGLang's multi-node launch:
node rank 0 listens on the dist-init address, waits until ranks 1..N-1 joined (as torch.distributed
initialisation blocks in SGLang), then loads the model and serves HTTP. A non-zero rank joins,
serves nothing and exits when rank 0 exits; rank 0 exits (code 1) when a joined rank leaves, as
SGLang does when a peer's NCCL connection breaks.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from gyre.engine.sglang_flags import LAUNCH_SERVER_FLAGS, SGLANG_VERSION

PROG = "gyre.engine.sglang_standin"
JOIN_TIMEOUT_S = 600.0  # default of --dist-timeout here: how long ranks wait for each other

# flag -> (argparse dest, type); None type = a switch. Aliases as in SGLang.
HONOURED: dict[str, tuple[str, type | None]] = {
    "--model-path": ("model_path", str), "--model": ("model_path", str),
    "--host": ("host", str), "--port": ("port", int),
    "--api-key": ("api_key", str),
    "--tp-size": ("tp_size", int), "--tensor-parallel-size": ("tp_size", int),
    "--nnodes": ("nnodes", int), "--node-rank": ("node_rank", int),
    "--dist-init-addr": ("dist_init_addr", str), "--nccl-init-addr": ("dist_init_addr", str),
    "--dist-timeout": ("dist_timeout", int),
    "--weight-version": ("weight_version", str),
    "--max-running-requests": ("max_running_requests", int),
    "--skip-tokenizer-init": ("skip_tokenizer_init", None),   # the embedded engine is token-in anyway
    "--enable-memory-saver": ("enable_memory_saver", None),   # release/resume are always available
    "--enable-priority-scheduling": ("enable_priority_scheduling", None),  # the embedded engine always is
    # return_routed_experts is always answered (MoE models)
    "--enable-return-routed-experts": ("enable_return_routed_experts", None),
}
# Real SGLang flags that only concern GPU memory, kernels or logging: accepted, without effect.
ACCEPTED_IGNORED: dict[str, type | None] = {
    "--mem-fraction-static": float, "--log-level": str, "--random-seed": int, "--base-gpu-id": int,
    "--trust-remote-code": None, "--disable-cuda-graph": None, "--enable-metrics": None,
}


class StandinUsageError(ValueError):
    pass


def resolve_flags(argv: list[str]) -> list[str]:
    """``argv`` with each option string resolved as SGLang's argparse would (exact name, else a
    unique prefix), refusing names SGLang does not have and SGLang flags the stand-in does not model."""
    out = []
    for tok in argv:
        if not tok.startswith("--") or tok == "--":
            out.append(tok)
            continue
        name, eq, value = tok.partition("=")
        if name not in LAUNCH_SERVER_FLAGS:
            matches = sorted(f for f in LAUNCH_SERVER_FLAGS if f.startswith(name))
            if not matches:
                raise StandinUsageError(f"unknown flag {name}: sglang.launch_server {SGLANG_VERSION} has no such "
                                        f"option (check the spelling against `python -m sglang.launch_server --help`)")
            if len(matches) > 1:
                shown = ", ".join(matches[:6]) + (", ..." if len(matches) > 6 else "")
                raise StandinUsageError(f"ambiguous flag {name}: could match {shown} (as in SGLang); "
                                        "spell the flag out")
            name = matches[0]
        if name not in HONOURED and name not in ACCEPTED_IGNORED:
            raise StandinUsageError(f"{name} is a flag of sglang.launch_server {SGLANG_VERSION} that the stand-in "
                                    f"does not model; drop it (e.g. from engine.sglang_args) when testing with "
                                    f"{PROG}. Modelled: {', '.join(sorted(HONOURED))}; accepted without effect: "
                                    f"{', '.join(sorted(ACCEPTED_IGNORED))}")
        out.append(name + eq + value)
    return out


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would exit; callers decide (main prints and returns 2)
        raise StandinUsageError(message)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = _Parser(prog=PROG, allow_abbrev=False,
                description=f"SGLang {SGLANG_VERSION} launch_server command line, served by Gyre's embedded engine")
    for dest, typ in dict(HONOURED.values()).items():  # one argument per dest, with SGLang's aliases
        aliases = [f for f, (d, _) in HONOURED.items() if d == dest]
        if typ is None:
            p.add_argument(*aliases, dest=dest, action="store_true")
        else:
            p.add_argument(*aliases, dest=dest, type=typ, default=None)
    for flag, typ in ACCEPTED_IGNORED.items():
        if typ is None:
            p.add_argument(flag, action="store_true")
        else:
            p.add_argument(flag, type=typ)
    args = p.parse_args(resolve_flags(argv))
    # SGLang's own defaults (server_args.py 0.5.23: host 127.0.0.1, port 30000, tp 1, nnodes 1)
    args.host = args.host or "127.0.0.1"
    args.port = 30000 if args.port is None else args.port
    args.tp_size = args.tp_size or 1
    args.nnodes = args.nnodes or 1
    args.node_rank = args.node_rank or 0
    args.weight_version = args.weight_version or "default"
    if not args.model_path:
        raise StandinUsageError("--model-path is required (a model directory in transformers layout)")
    if not (Path(args.model_path) / "config.json").is_file():
        raise StandinUsageError(f"--model-path {args.model_path}: no config.json there")
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise StandinUsageError(f"--node-rank {args.node_rank} must lie in 0..{args.nnodes - 1} (--nnodes {args.nnodes})")
    if args.tp_size < 1 or args.tp_size % args.nnodes:
        raise StandinUsageError(f"--tp-size {args.tp_size} must be divisible by --nnodes {args.nnodes} "
                                "(SGLang asserts tp_size % nnodes == 0)")
    if args.nnodes > 1:
        host, _, port = (args.dist_init_addr or "").rpartition(":")
        if not host or not port.isdigit():
            raise StandinUsageError(f"--dist-init-addr {args.dist_init_addr!r}: a multi-node launch needs HOST:PORT of "
                                    "node rank 0")
        args.dist_host, args.dist_port = host.strip("[]"), int(port)
    return args


# ---- the node ranks ----------------------------------------------------------------------------

def _hello(rank: int, nnodes: int) -> bytes:
    return f"gyre-standin rank {rank} nnodes {nnodes}\n".encode()


def gather_ranks(args) -> list[socket.socket]:
    """Node rank 0: listen on the dist-init address until every other rank has joined."""
    srv = socket.create_server((args.dist_host, args.dist_port))
    deadline = time.monotonic() + (args.dist_timeout or JOIN_TIMEOUT_S)
    joined: dict[int, socket.socket] = {}
    with srv:
        while len(joined) < args.nnodes - 1:
            srv.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                missing = sorted(set(range(1, args.nnodes)) - set(joined))
                raise RuntimeError(f"node ranks {missing} did not join at {args.dist_init_addr} in time") from None
            conn.settimeout(10)
            try:
                words = conn.makefile("rb").readline().decode(errors="replace").split()
            except OSError:
                conn.close()
                continue
            ok = len(words) == 5 and words[:2] == ["gyre-standin", "rank"] and words[2].isdigit() and \
                words[4] == str(args.nnodes)
            rank = int(words[2]) if ok else -1
            if not ok or not 1 <= rank < args.nnodes or rank in joined:
                conn.sendall(f"refused: expected a new rank of 1..{args.nnodes - 1} with nnodes {args.nnodes}\n".encode())
                conn.close()
                continue
            conn.sendall(b"ok\n")
            conn.settimeout(None)
            joined[rank] = conn
            print(f"{PROG}: node rank {rank} joined ({len(joined) + 1}/{args.nnodes})", file=sys.stderr, flush=True)
    return [joined[r] for r in sorted(joined)]


def follower(args) -> int:
    """Node rank > 0: join rank 0 (retrying until it listens), then wait for it to go away."""
    deadline = time.monotonic() + (args.dist_timeout or JOIN_TIMEOUT_S)
    while True:
        try:
            sock = socket.create_connection((args.dist_host, args.dist_port), timeout=5)
            break
        except OSError as e:
            if time.monotonic() > deadline:
                print(f"{PROG}: node rank {args.node_rank}: cannot reach {args.dist_init_addr}: {e}", file=sys.stderr)
                return 1
            time.sleep(0.2)
    with sock:
        sock.sendall(_hello(args.node_rank, args.nnodes))
        answer = sock.makefile("rb").readline().decode(errors="replace").strip()
        if answer != "ok":
            print(f"{PROG}: node rank {args.node_rank}: rank 0 {answer or 'closed the connection'}", file=sys.stderr)
            return 1
        print(f"{PROG}: node rank {args.node_rank} joined {args.dist_init_addr}", file=sys.stderr, flush=True)
        sock.settimeout(None)
        try:
            while sock.recv(64):
                pass
        except OSError:
            pass
    print(f"{PROG}: node rank {args.node_rank}: rank 0 is gone; exiting", file=sys.stderr, flush=True)
    return 0


def leader(args, peers: list[socket.socket]) -> int:
    """Node rank 0: load the model, serve SGLang's routes until SIGTERM/SIGINT or a peer leaves."""
    import torch

    from gyre.config import EngineConfig  # the stand-in is a separate program: its serving stack loads when it serves
    from gyre.model.families import ModelFormatError  # as above
    from gyre.engine.runtime import Engine  # as above
    from gyre.engine.server import serve  # as above

    torch.set_num_threads(1)  # as `gyre engine`: more threads only spin on shared CPUs
    defaults = EngineConfig()
    try:
        engine = Engine(args.model_path, weight_version=args.weight_version,
                        max_running=args.max_running_requests or defaults.max_running_requests,
                        max_new_tokens_cap=defaults.max_new_tokens_cap)
    except (ModelFormatError, OSError) as e:
        print(f"{PROG}: cannot serve {args.model_path}: {e}", file=sys.stderr)
        return 1
    lost: list[int] = []

    async def main() -> None:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)

        def watch(rank: int, sock: socket.socket) -> None:
            try:
                while sock.recv(64):
                    pass
            except OSError:
                pass
            lost.append(rank)
            loop.call_soon_threadsafe(task.cancel)

        for rank, sock in enumerate(peers, start=1):
            threading.Thread(target=watch, args=(rank, sock), daemon=True).start()
        await serve(engine, args.host, args.port, args.api_key, defaults.max_body_bytes)

    try:
        asyncio.run(main())
    except asyncio.CancelledError:
        pass
    for sock in peers:
        sock.close()
    if lost:
        print(f"{PROG}: node rank(s) {sorted(lost)} left; the server stopped", file=sys.stderr, flush=True)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except StandinUsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if args.node_rank > 0:
        return follower(args)
    peers: list[socket.socket] = []
    if args.nnodes > 1:
        try:
            peers = gather_ranks(args)
        except (OSError, RuntimeError) as e:
            print(f"{PROG}: node rank 0: {e}", file=sys.stderr)
            return 1
    return leader(args, peers)


if __name__ == "__main__":
    from gyre.fast_exit import exit_now

    exit_now(main())  # as `gyre engine`: without the interpreter's teardown of torch (~0.4 s a stop)
