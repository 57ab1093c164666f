"""The per-call journal (issue 34): each recorded call of a running execution, appended to the
run directory before its answer reaches the harness, so a head killed mid-execution loses at
most the call in flight.

One file per execution, ``<run.dir>/journal/<execution id>.jsonl``, one JSON line per call:
``{"input": sha256 of the input ids, "output_ids", "logprobs", "finish_reason", "weight_version"}``
(what gyre.proxy.replay answers a resumed harness with; the input ids themselves are not
written: the resumed harness sends them again, and the tree is rebuilt from its requests). A
line is written with one ``write`` before the answer goes out: it survives the process's death
(SIGKILL, a Slurm requeue) as the page cache does; a background thread fsyncs the journals
written to since its last pass (batched: a node's crash loses at most the last interval). When an
execution's record is durable in a shard its journal goes; on ``--resume`` a journal left behind
is an execution that was running, resumed by replay.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path

from gyre import faults

log = logging.getLogger("gyre.journal")
FSYNC_INTERVAL_S = 0.05


def input_key(ids) -> str:
    """The key of a call's input ids: sha256 of their JSON digits (``1, 2, 3``), the text the
    proxy already holds for the wire (gyre.proxy.capture.WireIds.json_text)."""
    text = getattr(ids, "json_text", None)
    if text is None:
        text = json.dumps([int(t) for t in ids])[1:-1]
    return hashlib.sha256(text.encode()).hexdigest()


class Journal:
    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._fds: dict[str, int] = {}
        self._dirty: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._syncer = threading.Thread(target=self._sync_loop, name="gyre-journal-fsync", daemon=True)
        self._syncer.start()

    def path(self, execution_id: str) -> Path:
        return self.dir / f"{execution_id}.jsonl"

    def append(self, execution_id: str, input_ids, output_ids: list[int], logprobs: list[float],
               finish_reason: str, weight_version: str) -> None:
        line = json.dumps({"input": input_key(input_ids), "output_ids": output_ids, "logprobs": logprobs,
                           "finish_reason": finish_reason, "weight_version": weight_version}) + "\n"
        fd = self._fds.get(execution_id)
        if fd is None:
            fd = self._fds[execution_id] = os.open(self.path(execution_id), os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                                                   0o600)
        os.write(fd, line.encode())
        with self._lock:
            self._dirty.add(fd)
        faults.hit("proxy", "call_journaled")

    def discard(self, execution_id: str) -> None:
        """The execution is in a shard: its journal is needed no more."""
        fd = self._fds.pop(execution_id, None)
        if fd is not None:
            with self._lock:
                self._dirty.discard(fd)
            os.close(fd)
        self.path(execution_id).unlink(missing_ok=True)

    def _sync_loop(self) -> None:
        while not self._stop.wait(FSYNC_INTERVAL_S):
            self.sync()

    def sync(self) -> None:
        with self._lock:
            dirty, self._dirty = self._dirty, set()
        for fd in dirty:
            try:
                os.fsync(fd)
            except OSError as e:  # closed meanwhile (discarded), or the disk: the next write says it
                log.debug("journal fsync: %s", e)

    def close(self) -> None:
        self._stop.set()
        self._syncer.join(5)
        self.sync()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def read_journal(path: str | os.PathLike) -> list[dict]:
    """The calls of a journal; a last line cut short by a crash is left out."""
    out = []
    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            break
        if isinstance(entry, dict) and {"input", "output_ids", "logprobs"} <= set(entry):
            out.append(entry)
    return out
