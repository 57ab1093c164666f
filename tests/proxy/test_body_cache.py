"""gyre.proxy.body_cache: a chat body parsed from where the execution's previous body stops
matching gives exactly what parse_json gives (values, key order, refusals), and parses only the
messages the previous body did not hold."""

from __future__ import annotations

import json

import pytest

from gyre.proxy.body import prompt_chars
from gyre.proxy.json_body import parse_json
from gyre.proxy.body_cache import BodyCache
from gyre.proxy.params import RequestError

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


def _outcome(f, raw: bytes):
    try:
        return "ok", f(raw)
    except RequestError as e:
        return "error", (e.status, e.message)


def _check(cache: BodyCache, raw: bytes) -> dict | None:
    """The cache's parse equals parse_json's, value, key order and error alike; its character
    count (when it gives one) equals prompt_chars'."""
    want = _outcome(lambda r: parse_json(r, depth=False), raw)
    got = _outcome(cache.parse, raw)
    if want[0] == "error":
        assert got == want
        return None
    assert got[0] == "ok"
    body, chars = got[1]
    assert body == want[1] and list(body) == list(want[1])
    assert json.dumps(body) == json.dumps(want[1])  # types too (1 vs 1.0 vs True)
    if chars is not None:
        assert chars == prompt_chars(body)
    return body


def _turns(n: int) -> list[dict]:
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "fix it"}]
    for i in range(n):
        msgs += [{"role": "assistant", "content": None,
                  "tool_calls": [{"id": f"c{i}", "type": "function",
                                  "function": {"name": "bash", "arguments": json.dumps({"command": f"ls {i}"})}}]},
                 {"role": "tool", "tool_call_id": f"c{i}", "content": f"out {i} é 😀 <|im_end|>"}]
    return msgs


@pytest.mark.parametrize("dumps", [
    lambda b: json.dumps(b),
    lambda b: json.dumps(b, indent=2),  # other whitespace: the cuts follow the text
    lambda b: json.dumps(b, ensure_ascii=False, separators=(",", ":")),
    lambda b: json.dumps({"messages": b["messages"], **{k: v for k, v in b.items() if k != "messages"}}),
])
def test_a_growing_conversation_parses_only_its_new_messages(dumps):
    cache = BodyCache()
    prev = None
    for n in range(8):
        messages = _turns(n)
        body = _check(cache, dumps({"model": "main", "messages": messages, "tools": TOOLS, "max_tokens": 64}).encode())
        assert cache.scanned == 2  # the first call: its two messages; later: the two new ones
        if prev is not None:  # the messages sent before are the very objects parsed then
            assert all(a is b for a, b in zip(body["messages"], prev["messages"]))
        prev = body


def test_an_edited_history_is_parsed_from_the_first_changed_message():
    cache = BodyCache()
    messages = _turns(6)
    _check(cache, json.dumps({"model": "m", "messages": messages}).encode())
    edited = messages[:5] + [{"role": "user", "content": "compacted"}] + messages[6:]
    _check(cache, json.dumps({"model": "m", "messages": edited}).encode())
    assert cache.scanned == len(edited) - 5
    _check(cache, json.dumps({"model": "other", "messages": edited}).encode())  # the text before them changed
    assert cache.scanned == len(edited)
    _check(cache, json.dumps({"model": "other", "messages": edited[:3]}).encode())  # a shorter history
    assert cache.scanned == 0


@pytest.mark.parametrize("second", [
    b'{"model": "m", "messages": [{"role": "user", "content": "a"}], "model": "n"}',  # the last key wins
    b'{"model": "m", "messages": [{"role": "user", "content": "a"}], "messages": []}',  # messages twice
    b'{"model": "m", "messages": [{"role": "user", "content": "a"},]}',  # trailing comma
    b'{"model": "m", "messages": [{"role": "user", "content": "a"}],}',
    b'{"model": "m", "messages": [{"role": "user", "content": "a"}]} x',  # extra data
    b'{"model": "m", "messages": [{"role": "user", "content": "a"}]',  # cut short
    b'{"model": "m", "messages": [{"role": "user", "content": "a"} {"role": "user"}]}',
    b'{"model": "m", "messages": [{"role": "user", "content": "a"}, 12]}',
    b'{"model": "m", "messages": [{"role": "user", "content": "a"}, {"content": "\\ud83d"}]}',  # lone surrogate
    b'{"model": "m", "messages": [{"role": "user", "content": "a"}, {"content": "\\ud83d\\ude00"}]}',  # a pair
    b'{"model": "m", "messages": [{"role": "user", "content": "a"}, {"content": "\xff"}]}',  # not UTF-8
    b'{"model": "m", "messages": [{"role": "user", "content": "a"}, NaN, 1e400]}',
    b'{"model": "m", "messages": "text"}',
    b'{"model": "m"}',
    b'[1, 2]',
    b'\xef\xbb\xbf{"model": "m", "messages": []}',  # a BOM
    b'{"model": "m", "messages": [{"role": "user", "content": "a"}, {"a": ' + b"[" * 5000 + b"]" * 5000 + b"}]}",
])
def test_odd_bodies_are_parsed_or_refused_as_parse_json_does(second):
    cache = BodyCache()
    _check(cache, b'{"model": "m", "messages": [{"role": "user", "content": "a"}]}')
    _check(cache, second)
    # and the cache still serves the next ordinary body
    _check(cache, b'{"model": "m", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}')


def test_a_number_that_goes_on_is_not_taken_as_kept():
    cache = BodyCache()
    _check(cache, b'{"model": "m", "messages": [1]}')
    assert _check(cache, b'{"model": "m", "messages": [12]}')["messages"] == [12]
