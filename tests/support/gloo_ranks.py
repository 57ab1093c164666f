"""Spawned torch.distributed ranks over gloo on this machine, for the multi-rank trainer tests.

Each call starts fresh rank processes, forked from one multiprocessing fork server per test
process that has imported torch and Megatron-Core once. A rank spawned from scratch spent ~6 s of
CPU importing them against ~0.1 s of work, and the unit tests start eight pairs of ranks; forked,
each rank is still a new process (no state carried from one test to the next) without the imports.
"""

from __future__ import annotations

import multiprocessing
import queue
import socket
import time
from typing import Callable

# what a rank imports, loaded once by the fork server (the transformers configs: a rank unpickles one)
PRELOAD = ["torch", "transformers.models.qwen2.configuration_qwen2", "transformers.models.qwen3_moe.configuration_qwen3_moe",
           "megatron.core", "megatron.core.distributed", "megatron.core.optimizer",
           "gyre.train.megatron_trainer", "gyre.train.megatron_model", "gyre.train.dist",
           "support.megatron_layouts", "support.megatron_checkpoint", "support.megatron_moe", "support.cp_attention"]


def _context():
    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts: the first call
    return multiprocessing.get_context("forkserver")


def spawned_ranks(target: Callable, hf_config, hf_state: dict, replies: int, world: int = 2,
                  timeout_s: float = 300) -> list:
    """``target(rank, port, hf_config, hf_state, out)`` in ``world`` new processes that meet on a
    free local port; the first ``replies`` objects they put on ``out`` (numpy arrays, not tensors:
    a tensor's shared memory goes with its process). Every process must exit 0; one that exits
    otherwise before the replies are in fails the call at once (its peers are stopped)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = _context()
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, port, hf_config, hf_state, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = [_reply(out, procs, time.monotonic() + timeout_s) for _ in range(replies)]
    except BaseException:
        for p in procs:
            p.kill()
            p.join()
        raise
    for p in procs:  # joined after the replies are read: a full queue blocks its writer
        p.join(timeout=60)
        assert p.exitcode == 0, f"rank exited {p.exitcode}"
    return results


def _reply(out, procs: list, deadline: float):
    while True:
        try:
            return out.get(timeout=0.2)
        except queue.Empty:
            failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            assert not failed, f"rank {failed[0][0]} exited {failed[0][1]} before replying (its traceback is above)"
            if time.monotonic() > deadline:
                raise TimeoutError("the ranks sent no reply in time") from None

