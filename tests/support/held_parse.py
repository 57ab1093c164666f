"""A body parser for the proxy's worker process that stops at a named point until the test lets it
go: it reports the body's tag (its first message's first word) on ``entered`` and waits on
``release`` (both from a multiprocessing Manager, so they reach a spawned worker)."""

from __future__ import annotations

import json
import os

from gyre.proxy.body import parse_chat_body


def held_parse(entered, release, raw: bytes, limit, max_token_chars):
    tag = json.loads(raw)["messages"][0]["content"].split(" ", 1)[0]
    entered.put((tag, os.getpid()))
    if not release.wait(60):
        raise TimeoutError("held_parse: the test never released the parse")
    return parse_chat_body(raw, limit, max_token_chars)
