"""A chat body parsed from where the execution's previous body stops matching (issue 28).

An agent re-sends its whole history on every call, so most of a body is the previous body's
bytes. ``json.loads`` of the whole body grew with the execution (the largest per-call cost left
in the proxy at 16K tokens: 0.2 ms of a 0.8 ms call), and walking every message for the cheap
bound's character count cost as much again in Python. Here the previous body's bytes are kept
with the offset where each of its messages ends: the new body is compared to them (memcmp, not
per message), the matched messages are taken over as the very same objects (so the walk's own
prefix comparison, gyre.proxy.capture.Walked.common, finds them equal by identity), and only the
rest is decoded and parsed, value by value, with json's own scanner.

The result equals ``parse_json(raw, depth=False)``: the same values, the same key order and
duplicate-key rule (the last wins), the same refusals. Anything this parser does not follow (not
an object, no ``messages`` list, ``messages`` twice, invalid JSON or UTF-8) goes to ``parse_json``
itself, which parses or refuses it as it always did. The parsed message objects are shared
between calls, which holds because nothing in the proxy mutates a request (the walk already keeps
them from one call to the next).
"""

from __future__ import annotations

import json
from json.decoder import WHITESPACE, scanstring

from gyre.proxy.json_body import has_lone_surrogate, lone_surrogate_error, parse_json
from gyre.proxy.offload import text_chars

_scan = json.JSONDecoder().scan_once  # what json.loads parses every value with
_ws = WHITESPACE.match


class _Unfollowed(Exception):
    """A body this parser leaves to parse_json (it refuses or parses it as always)."""


class BodyCache:
    """One execution's last chat body: its bytes, its parse, where each message ends."""

    def __init__(self) -> None:
        self.raw = b""
        self.head: dict = {}        # top-level keys before "messages", as parsed
        self.opened = -1            # byte just after the messages array's "["; -1: nothing kept
        self.messages: list = []
        self.ends: list[int] = []   # byte just after each message
        self.chars: list[int] = []  # text characters of messages[:i + 1] (the cheap bound's count)
        self.scanned = 0            # messages the last parse scanned (the rest were taken over; -1: parse_json)

    def parse(self, raw: bytes, whole: bool = True) -> tuple[dict, int | None] | None:
        """The body as ``parse_json(raw, depth=False)`` gives it, and the characters of its
        messages and tools (gyre.proxy.body.prompt_chars; None when not counted here).
        ``whole=False``: None instead of parsing what is not followed here with parse_json."""
        try:
            return self._parse(raw, self._kept(raw))
        except (_Unfollowed, ValueError, StopIteration, IndexError, RecursionError):
            self.scanned = -1
            if not whole:
                return None
            return parse_json(raw, depth=False), None  # it refuses it, or parses it all

    def kept(self) -> tuple:
        """What the last parse keeps besides its bytes and messages: handed back by a worker
        process that parsed a big body (gyre.proxy.body.parse_chat_body), for `adopt`."""
        return self.head, self.opened, self.ends, self.chars

    def adopt(self, raw: bytes, body: dict, kept: tuple) -> None:
        """Keep ``raw``, parsed elsewhere into ``body`` by a BodyCache whose `kept` this is."""
        self.head, self.opened, self.ends, self.chars = kept
        self.raw, self.messages = raw, body["messages"]
        self.scanned = len(self.messages)  # all, by the worker

    def follows(self, raw: bytes, most: int) -> bool:
        """Whether ``raw`` is the kept body through its last message, then at most ``most``
        bytes (a big body that parses in a moment here)."""
        n = self.ends[-1] if self.ends else self.opened
        return n > 0 and len(raw) - n <= most and raw.startswith(self.raw[:n])

    def _kept(self, raw: bytes) -> int:
        """How many of the kept messages ``raw`` starts with, byte for byte (-1: not even the
        bytes before the first one)."""
        if self.opened < 0 or not raw.startswith(self.raw[:self.opened]):
            return -1
        n = len(self.ends)
        if n and raw.startswith(self.raw[:self.ends[-1]]):  # the usual case: the history grew at its end
            return n
        lo, hi = 0, n - 1  # binary search: a prefix through message k matches iff it does through each before
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if raw.startswith(self.raw[:self.ends[mid - 1]]):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _parse(self, raw: bytes, kept: int) -> tuple[dict, int]:
        fresh: list = []  # values parsed now (the surrogate check covers only these)
        if kept < 0:
            start = 0
        else:
            start = self.ends[kept - 1] if kept else self.opened
        # the kept bytes end after "[" or "}": the rest starts on a character boundary
        text = raw[start:].decode("utf-8")
        pos = _Bytes(text, start)
        if kept < 0:
            i = _ws(text, 0).end()
            if text[i:i + 1] != "{":
                raise _Unfollowed
            body: dict = {}
            i = self._keys(text, _ws(text, i + 1).end(), body, fresh, until_messages=True)
            opened, messages, ends, first = pos.at(i), [], [], True
        else:
            body, opened = dict(self.head), self.opened
            messages, ends = self.messages[:kept], self.ends[:kept]
            i, first = 0, not kept
        head = dict(body)
        n_kept = len(messages)
        i = self._elements(text, i, first, messages, ends, pos)
        body["messages"] = messages
        fresh += messages[n_kept:]
        i = _ws(text, i).end()
        if text[i] == ",":
            i = self._keys(text, _ws(text, i + 1).end(), body, fresh, until_messages=False)
        elif text[i] == "}":
            i += 1
        else:
            raise _Unfollowed
        if _ws(text, i).end() != len(text):
            raise _Unfollowed  # extra data: parse_json says where
        if has_lone_surrogate(text, fresh):  # the kept bytes passed this check when they came
            raise lone_surrogate_error()
        chars = self.chars[:n_kept]
        for m in messages[n_kept:]:
            chars.append((chars[-1] if chars else 0) + text_chars(m))
        self.raw, self.head, self.opened, self.messages, self.ends, self.chars = raw, head, opened, messages, ends, chars
        self.scanned = len(messages) - n_kept
        return body, (chars[-1] if chars else 0) + text_chars(body.get("tools"))

    @staticmethod
    def _keys(text: str, i: int, body: dict, fresh: list, until_messages: bool) -> int:
        """Parse ``"key": value`` pairs from ``i`` into ``body``; returns the offset of the
        messages array's first element (``until_messages``) or just after the closing brace."""
        while True:
            if text[i] != '"':
                raise _Unfollowed  # no messages at all, or a trailing comma
            key, i = scanstring(text, i + 1)
            i = _ws(text, i).end()
            if text[i] != ":":
                raise _Unfollowed
            i = _ws(text, i + 1).end()
            if key == "messages":
                if not until_messages or text[i] != "[":
                    raise _Unfollowed  # twice (the last would win), or not a list
                return i + 1
            body[key], i = _scan(text, i)
            fresh.append(body[key])
            i = _ws(text, i).end()
            if text[i] == ",":
                i = _ws(text, i + 1).end()
                continue
            if text[i] == "}" and not until_messages:
                return i + 1
            raise _Unfollowed

    @staticmethod
    def _elements(text: str, i: int, first: bool, messages: list, ends: list, pos: "_Bytes") -> int:
        """Parse the messages array's elements from ``i`` (just after "[" when ``first``, else
        just after a kept element); returns the offset after its "]"."""
        i = _ws(text, i).end()
        if text[i] == "]":
            return i + 1
        if not first:
            if text[i] != ",":
                raise _Unfollowed
            i = _ws(text, i + 1).end()
        while True:
            value, i = _scan(text, i)
            messages.append(value)
            ends.append(pos.at(i))
            i = _ws(text, i).end()
            if text[i] == "]":
                return i + 1
            if text[i] != ",":
                raise _Unfollowed
            i = _ws(text, i + 1).end()


class _Bytes:
    """Byte offsets in the body of character offsets in its decoded rest (asked in order)."""

    def __init__(self, text: str, start: int):
        self.text, self.ascii = text, text.isascii()
        self.char, self.byte = 0, start

    def at(self, char: int) -> int:
        if self.ascii:
            return self.byte + char
        self.byte += len(self.text[self.char:char].encode("utf-8"))
        self.char = char
        return self.byte
