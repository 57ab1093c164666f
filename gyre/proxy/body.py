"""A request body as checked JSON: UTF-8, JSON, an object, nesting depth, no lone surrogate.

``parse_json`` runs on the proxy's event loop for a small body; ``parse_chat_body`` runs in a
worker process for a big chat body (gyre.proxy.offload), where it also counts the characters the
cheap bound needs. Both raise or report the same errors, word for word. This module imports
nothing heavy: it is what a worker process loads.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from gyre.proxy.offload import text_chars
from gyre.proxy.params import MAX_DEPTH, RequestError, check_depth

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")  # high (d800-dbff) or low (dc00-dfff)
ROLE_CHARS = 128  # the most of the model name an agent role keeps (gyre.proxy.server.agent_role_of)


def parse_json(raw: bytes, depth: bool = True) -> dict:
    """The body's JSON object; ``depth=False``: the caller checks its nesting (a chat call
    skips the messages an earlier call of its execution sent)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(400, f"request body is not valid UTF-8 (byte {e.start})")
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(400, f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}")
    except RecursionError:
        raise RequestError(400, "request body is nested too deeply")
    except ValueError as e:  # e.g. an integer of more than 4,300 digits
        raise RequestError(400, f"request body is not acceptable JSON: {e}")
    if not isinstance(body, dict):
        raise RequestError(400, f"request body must be a JSON object, got {type(body).__name__}")
    if depth:
        check_depth(body)
    if has_lone_surrogate(text, body):
        raise lone_surrogate_error()
    return body


def has_lone_surrogate(text: str, parsed) -> bool:
    """Whether ``parsed`` (the values of JSON ``text``) holds half a surrogate pair: json.loads
    joins a pair of escapes, and takes a lone half as a character that cannot be encoded."""
    if "\\u" not in text or not _SURROGATE_ESCAPE.search(text):  # cheap test first: bodies reach MBs
        return False
    try:
        json.dumps(parsed, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def lone_surrogate_error() -> RequestError:
    return RequestError(400, "request body contains a lone UTF-16 surrogate escape (\\ud800-\\udfff "
                             "without its pair); send valid Unicode text")


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
    from gyre.proxy.body_cache import BodyCache  # here: it imports this module

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
