"""A request body as checked JSON: UTF-8, JSON, an object, nesting depth, no lone surrogate.

``parse_json`` (gyre.proxy.json_body) runs on the proxy's event loop for a small body; ``parse_chat_body`` runs in a
worker process for a big chat body (gyre.proxy.offload), where it also counts the characters the
cheap bound needs. Both raise or report the same errors, word for word. This module imports
nothing heavy: it is what a worker process loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gyre.proxy.body_cache import BodyCache
from gyre.proxy.offload import text_chars
from gyre.proxy.params import MAX_DEPTH, RequestError, check_depth

ROLE_CHARS = 128  # the most of the model name an agent role keeps (gyre.proxy.routes.agent_role_of)


def prompt_chars(body: dict) -> int:
    """Characters in the strings of a chat body's messages and tools (the cheap bound's input)."""
    return text_chars(body.get("messages")) + text_chars(body.get("tools"))


def over_bound(chars: int, limit: int | None, max_token_chars: int) -> bool:
    """Whether a prompt of ``chars`` characters renders to more than ``limit`` tokens for certain
    (gyre.proxy.offload: a token covers at most ``max_token_chars`` characters)."""
    return limit is not None and chars // max_token_chars > limit


@dataclass(frozen=True)
class ChatBody:
    """A parsed chat body and its prompt characters. Over the bound, ``body`` holds only the
    model name (what the agent role is read from): the messages are never sent back."""
    body: dict
    chars: int
    kept: tuple | None = None  # where its messages end (gyre.proxy.body_cache.BodyCache.kept)


def parse_chat_body(raw: bytes, limit: int | None, max_token_chars: int) -> ChatBody | tuple:
    """In a worker process: the checked body, or a refusal as RequestError's arguments (an
    exception with keyword fields does not survive pickling). The checks come in the proxy's
    order, so a body with two faults is refused for the same one: the bound before the nesting
    check the proxy makes before rendering (the rest of the body, then the messages one level
    down). That check also keeps pickling the answer clear of Python's recursion limit."""
    cache = BodyCache()  # parses as parse_json(raw, depth=False), noting where each message ends
    try:
        body, chars = cache.parse(raw)
        chars = prompt_chars(body) if chars is None else chars
        if over_bound(chars, limit, max_token_chars):
            model = body.get("model")
            # agent_role_of reads at most ROLE_CHARS of it: that prefix decides the same role
            return ChatBody({"model": model[:ROLE_CHARS]} if isinstance(model, str) else {}, chars)
        check_depth({k: v for k, v in body.items() if k != "messages"})
        check_depth(body.get("messages"), MAX_DEPTH - 1)
    except RequestError as e:
        return e.status, e.message, e.type, e.code, e.param
    return ChatBody(body, chars, cache.kept() if cache.scanned >= 0 else None)


def refusal(answer: Any) -> RequestError | None:
    """The RequestError a worker's answer stands for, or None for a ChatBody."""
    return None if isinstance(answer, ChatBody) else RequestError(*answer)
