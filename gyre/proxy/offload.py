"""Heavy per-call work off the proxy's event loop (issue 34): a request's rendering and
tokenization run in a small bounded thread pool, after a cheap bound that refuses an oversized
prompt in milliseconds.

The bound: a token of the vocabulary covers at most ``max_token_chars`` characters of text (the
longest vocabulary entry: byte-level and SentencePiece vocabularies both spell a token with at
least one character per character it covers), so a request whose strings hold C characters
renders to at least C / max_token_chars tokens. Over the engine's input limit it can be refused
before a single token is produced.

The tokenizer releases the GIL only in ``encode_batch`` (measured: ``encode`` holds it for the
whole text), which is why long texts are encoded through it (gyre.proxy.capture.Renderer): only
then does a worker thread leave the loop free. One call per execution prepares at a time (its
tree is read there and written when a call is recorded), so one execution's burst queues behind
its own calls, never another's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

WORKERS = max(2, min(4, os.cpu_count() or 2))  # tokenization is CPU work: more threads than cores buy nothing
# A request whose strings hold at most this many characters is prepared on the loop: at about 3 us
# a character (measured, tiny-qwen tokenizer) it costs under 50 ms at worst, less than waiting for a
# worker another execution's big request holds.
INLINE_CHARS = 16_384


def max_token_chars(tokenizer) -> int:
    """The most characters any one token of ``tokenizer`` covers (its longest vocabulary entry)."""
    return max(map(len, tokenizer.get_vocab(with_added_tokens=True)), default=1)


def text_chars(value: Any) -> int:
    """Characters in every string of a parsed JSON value (walked without recursion)."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return total


class PrepareWorkers:
    """The bounded pool and the per-execution order of preparing and recording."""

    def __init__(self, workers: int = WORKERS):
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gyre-prepare")
        self._locks: dict[str, asyncio.Lock] = {}
        self._holders: dict[str, int] = {}

    @contextlib.asynccontextmanager
    async def session(self, execution_id: str) -> Iterator[None]:
        """Held while a call of ``execution_id`` reads its tree off the loop, or records into it."""
        lock = self._locks.setdefault(execution_id, asyncio.Lock())
        self._holders[execution_id] = self._holders.get(execution_id, 0) + 1
        try:
            async with lock:
                yield
        finally:
            self._holders[execution_id] -= 1
            if not self._holders[execution_id]:  # nobody waits: the lock goes with the last user
                del self._holders[execution_id], self._locks[execution_id]

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
