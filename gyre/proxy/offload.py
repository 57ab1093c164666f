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

A big request body is parsed in a worker process instead (``PrepareWorkers.parse``): json.loads
holds the GIL for its whole run (a 7.5 MB body: 40-75 ms on 2 busy cores), so no thread can
help. The process checks the body and applies the bound (gyre.proxy.body) and answers with the
refusal alone (the loop is held 5-8 ms for a refused 7.5 MB body), or the parsed body pickled:
unpickling a dict is a copy of its strings (measured for 7.5 MB: 0.8 ms for one ASCII text,
14 ms for CJK, 1 ms for 10,000 messages, 46 ms for 100,000 tiny ones, against 17-92 ms for
json.loads of the same). Rendering and tokenizing in the process as well, with token ids back
as bytes, is not possible: the renderer reuses the tokens of the execution's tree (exact token
reuse), which lives in this process; and the tokenizer already runs with the GIL released.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Iterator

WORKERS = max(2, min(4, os.cpu_count() or 2))  # tokenization is CPU work: more threads than cores buy nothing
# A request whose strings hold at most this many characters is prepared on the loop: at about 3 us
# a character (measured, tiny-qwen tokenizer) it costs under 50 ms at worst, less than waiting for a
# worker another execution's big request holds. Counted over what the preparation may tokenize: the
# messages its execution's last call did not send, where only those are rendered (Proxy._fresh_chars).
INLINE_CHARS = 16_384
# A chat body of more bytes is parsed in a worker process. Measured on 2 busy cores: json.loads
# of 256 KB holds the loop 0.5 ms (one long text) to 6 ms (many small messages); the round trip
# to a process adds 2-7 ms to the call and holds the loop 1-4 ms.
BIG_BODY_BYTES = 256 << 10
# Parsing is short and the bound refuses an oversized prompt there: two processes are enough for
# every execution's big bodies, as each execution has at most one of them in a process at a time.
PARSE_PROCESSES = 2
# A big body travels to its process through a private file, in memory where there is /dev/shm.
SPILL_DIR = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


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

    def __init__(self, workers: int = WORKERS, processes: int = PARSE_PROCESSES):
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gyre-prepare")
        self.processes = processes
        self._parsers: ProcessPoolExecutor | None = None  # started by the first big body
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

    async def parse(self, fn, raw: bytes, *args):
        """``fn(raw, *args)`` in a worker process (``fn`` and its answer travel pickled). ``raw``
        goes through a private file, written by a thread with the GIL released and read by the
        worker at once: measured for 7.5 MB on 2 busy cores, 7 ms against 22 ms through the pool's
        pipe (its 64 KB writes each wait for the worker to be scheduled, and each takes the GIL
        back). A pool whose process died is replaced by the next call; this one fails (the caller
        answers 503)."""
        if self._parsers is None:
            # spawn: forking a process that runs the loop, the tokenizer's threads and aiohttp is unsafe
            self._parsers = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"))
        pool = self._parsers
        path = await asyncio.to_thread(_spill, raw)
        try:
            return await asyncio.wrap_future(pool.submit(_from_file, fn, path, *args))
        except BrokenProcessPool:
            if self._parsers is pool:
                self._parsers = None
                pool.shutdown(wait=False, cancel_futures=True)
            raise
        finally:
            os.unlink(path)  # a worker that has it open reads on; one that has not is answering no one

    def close_parsers(self) -> None:
        """Stop the worker processes (a later big body starts them again)."""
        pool, self._parsers = self._parsers, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def close(self) -> None:
        self.close_parsers()
        self.pool.shutdown(wait=False, cancel_futures=True)


def _spill(raw: bytes) -> str:
    """``raw`` in a new file only this user can read; its path."""
    fd, path = tempfile.mkstemp(prefix="gyre-body-", dir=SPILL_DIR)
    with os.fdopen(fd, "wb") as f:
        f.write(raw)
    return path


def _from_file(fn, path: str, *args):
    """In a worker process: ``fn`` of the bytes ``_spill`` wrote."""
    with open(path, "rb") as f:
        return fn(f.read(), *args)
