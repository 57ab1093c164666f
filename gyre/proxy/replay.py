"""Replay-resume: a stopped execution's recorded calls answered again from its tree.

When an execution that was running is resumed (preemption, SIGTERM, ``--resume``), its harness
starts over in a fresh copy of the task's initial workspace. Each request whose rendered input
ids equal a recorded call's input ids gets that call's recorded output (same tokens, log-probs and
weight version; no engine time), streamed token by token when asked to stream. The first request
that matches nothing (the harness diverged, or the recording ended) ends the replay: it and every
later call are generated live and branch the tree. Tool calls are the harness's own and run for
real, so the workspace is what the harness believes it is.

`Replay.match` returns an object with the router's two generation methods, so the proxy sends a
replayed call down exactly the code path of a live one (recording, parsing, OpenAI shapes).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import AsyncIterator

from gyre.engine.client import GenerateResult
from gyre.proxy.journal import input_key
from gyre.traj.tree import TrajectoryTree

REPLAY_ENDPOINT = "replay"  # the endpoint a replayed call is recorded with: it cost no engine time


def replayed_calls(tree) -> int:
    """Calls of a (resumed) execution's tree answered from its recording."""
    return sum(c.endpoint == REPLAY_ENDPOINT for c in tree.calls)


@dataclass
class Recorded:
    """One recorded call's answer, shaped as the router's result."""
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: str

    def _result(self, n: int, final: bool) -> GenerateResult:
        return GenerateResult(output_ids=self.output_ids[:n], logprobs=self.logprobs[:n],
                              finish_reason=self.finish_reason if final else None,
                              weight_version=self.weight_version, endpoint=REPLAY_ENDPOINT)

    async def generate(self, *_args, **_kw) -> GenerateResult:
        return self._result(len(self.output_ids), True)

    async def generate_stream(self, *_args, **_kw) -> AsyncIterator[GenerateResult]:
        # cumulative snapshots, one per token, then the final one: what a live stream looks like
        for n in range(1, len(self.output_ids) + 1):
            yield self._result(n, False)
        yield self._result(len(self.output_ids), True)


class Replay:
    """The recorded calls of one execution, by their exact input ids (their key,
    gyre.proxy.journal.input_key): from a stopped execution's tree, or from the journal of one
    that was running when the head was killed (:meth:`from_journal`)."""

    def __init__(self, tree: TrajectoryTree | None = None):
        self._by_input: dict[str, collections.deque[Recorded]] = {}
        self.recorded = 0
        for call in tree.calls if tree is not None else ():
            leaf = tree.nodes[call.leaf]
            self._add(input_key(tree.call_input_ids(call).tolist()), Recorded(
                [int(t) for t in leaf.tokens[leaf.target_start:]], [float(x) for x in leaf.logprobs],
                call.finish_reason, call.weight_version))
        self._start()

    @classmethod
    def from_journal(cls, entries: list[dict]) -> "Replay":
        r = cls()
        for e in entries:
            r._add(e["input"], Recorded([int(t) for t in e["output_ids"]], [float(x) for x in e["logprobs"]],
                                        e.get("finish_reason") or "stop", str(e.get("weight_version", ""))))
        r._start()
        return r

    def _add(self, key: str, rec: Recorded) -> None:
        self._by_input.setdefault(key, collections.deque()).append(rec)
        self.recorded += 1

    def _start(self) -> None:
        self.replayed = 0
        self.active = self.recorded > 0
        self.diverged = False  # a request matched nothing while calls were left

    def match(self, input_ids) -> Recorded | None:
        """The recorded answer for these input ids (each recorded call answers once), or None:
        then the replay is over for good and this call and every later one go live."""
        if not self.active:
            return None
        queue = self._by_input.get(input_key(input_ids))
        if not queue:
            self.active = False
            self.diverged = self.replayed < self.recorded
            return None
        self.replayed += 1
        return queue.popleft()
