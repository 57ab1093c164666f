"""One chat completion between parsing and recording, and the ways a call fails.

The proxy (gyre.proxy.server) builds a `Call` per request; the recording (gyre.proxy.recording),
the streaming relay (gyre.proxy.relay) and the HTTP routes (gyre.proxy.routes) share it and the
errors here, so none of them imports the proxy itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from gyre.engine.client import EngineError
from gyre.proxy.capture import ExecutionSession, PreparedCall
from gyre.proxy.params import CallParams, RequestError

_CONTEXT_RE = re.compile(r"\((\d+) tokens\) is longer than the model's context length \((\d+) tokens\)")


def context_error(tokens: int, limit: int, at_least: bool = False) -> RequestError:
    """OpenAI's own wording and code, which the openai SDK and litellm map to their
    context-window exceptions (so a harness can compact and go on)."""
    return RequestError(400, f"This model's maximum context length is {limit} tokens. However, your messages "
                             f"resulted in {'at least ' if at_least else ''}{tokens} tokens. Please reduce the "
                             "length of the messages.",
                        code="context_length_exceeded", param="messages")


def engine_failure(e: Exception) -> RequestError:
    """An engine-side failure as the harness should see it: its own request's fault -> 4xx,
    the backend's -> 5xx (retryable)."""
    if isinstance(e, EngineError) and e.status is not None and 400 <= e.status < 500 and e.status != 429:
        m = _CONTEXT_RE.search(e.message)
        if m:
            return context_error(int(m.group(1)), int(m.group(2)) - 1)
        return RequestError(400, f"the model engine refused the request: {e.message}")
    return RequestError(503, f"model backend unavailable, retry later: {e}", "server_error", "backend_unavailable")


class TooManyExecutions(ValueError):
    """The proxy holds `max_executions` registered executions already."""


class AbortedCall(Exception):
    """The engine aborted the generation and the router could not finish it elsewhere."""


@dataclass
class Call:
    """One chat completion between parsing and recording."""
    sess: ExecutionSession
    body: dict
    role: str
    params: CallParams
    tools: list[dict]
    prepared: PreparedCall
    forced: list[int]  # assistant ids placed before sampling (tool_choice), recorded as prompt
    engine_params: dict
    rid: str
    t0: float
    engine_s: float = 0.0  # time on the wire to the engine and back (not the proxy's own work)
    priority: int | None = None  # the engines admit higher first (gyre.proxy.fairness)
    wire: Any = None  # the input ids as sent (their key journals the call, gyre.proxy.journal)
    # the request's messages for the next call's walk (capture.remember): raw, tools salt, offset,
    # parsed messages, their keys
    walk: tuple = ()

    @property
    def id(self) -> str:
        return f"chatcmpl-{self.rid}"

