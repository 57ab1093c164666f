"""Fair serving across executions (issue 34): a per-execution cap on calls in flight, and the
priority each call carries to the engine.

Beyond ``proxy.max_calls_in_flight`` calls of one execution at once, a call is refused with 429
and ``Retry-After`` (the openai SDK and litellm wait and retry it). Below the cap, each call is
sent with ``priority = -(calls of its execution already in flight)``: the engines admit higher
priorities first (SGLang with ``--enable-priority-scheduling``, which Gyre launches it with; the
embedded engine always), so a sibling's first call is admitted before a burst's second, and one
execution's burst waits behind its own calls: round robin by calls in flight. The differences stay
within SGLang's preemption threshold (10), so running generations are never preempted; what SGLang does not offer is a share by tokens (a deficit scheduler): a long
generation, once admitted, runs to its end.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Iterator

from gyre.proxy.params import RequestError

RETRY_AFTER_S = 1
PRIORITY_FLOOR = 9  # |priority| stays under SGLang's preemption threshold (10): nothing running is preempted


class TooManyCalls(RequestError):
    """429: the execution has ``max_calls_in_flight`` calls running already."""

    def __init__(self, execution_id: str, limit: int):
        super().__init__(429, f"execution {execution_id} has {limit} calls in flight, the limit "
                              f"(proxy.max_calls_in_flight); retry after {RETRY_AFTER_S} s or wait for "
                              "an answer first", "rate_limit_error", "too_many_calls_in_flight")
        self.headers = {"Retry-After": str(RETRY_AFTER_S)}


class CallGate:
    def __init__(self, max_in_flight: int):
        self.max_in_flight = max_in_flight
        self.in_flight: collections.Counter[str] = collections.Counter()
        self.refused = 0

    @contextlib.contextmanager
    def admit(self, execution_id: str) -> Iterator[int]:
        """Hold one of the execution's slots; yields the call's engine priority."""
        n = self.in_flight[execution_id]
        if n >= self.max_in_flight:
            self.refused += 1
            raise TooManyCalls(execution_id, self.max_in_flight)
        self.in_flight[execution_id] = n + 1
        try:
            yield -min(n, PRIORITY_FLOOR)
        finally:
            self.in_flight[execution_id] -= 1
            if not self.in_flight[execution_id]:
                del self.in_flight[execution_id]
