"""Checked JSON, the bottom of a request body: UTF-8, JSON, an object, nesting depth, no lone
surrogate. Both the whole-body parser (gyre.proxy.body) and the incremental one
(gyre.proxy.body_cache) stand on it, so neither imports the other's module."""

from __future__ import annotations

import json
import re

from gyre.proxy.params import RequestError, check_depth

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")  # high (d800-dbff) or low (dc00-dfff)


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
