"""Spawned torch.distributed ranks over gloo on this machine, for the multi-rank trainer tests."""

from __future__ import annotations

import socket
from typing import Callable


def spawned_ranks(target: Callable, hf_config, hf_state: dict, replies: int, world: int = 2,
                  timeout_s: float = 300) -> list:
    """``target(rank, port, hf_config, hf_state, out)`` in ``world`` spawned processes that meet on a
    free local port; the first ``replies`` objects they put on ``out`` (numpy arrays, not tensors:
    a tensor's shared memory goes with its process). Every process must exit 0."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, port, hf_config, hf_state, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = [out.get(timeout=timeout_s) for _ in range(replies)]  # before join: a full queue blocks its writer
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0, f"rank exited {p.exitcode}"
    return results
