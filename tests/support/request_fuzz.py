"""Seeded mutations of a valid chat-completion request over its schema, for the proxy's
"no 5xx for a client's fault" check (tests/proxy/test_proxy_hostile.py, benchmarks/bench_hostile.py).

Each case is raw request bytes plus extra headers: a field of a full request (messages of every
role, tools, tool calls, parameters) replaced by a value of another type or an extreme one
(numbers at float and integer limits, lone surrogates and control characters, JSON escapes),
a field deleted or added, deep nesting (also inside tool-call argument text), an odd agent-role
header, or broken bytes and encodings.
"""

from __future__ import annotations

import copy
import json
import random

BASE = {
    "model": "main",
    "messages": [
        {"role": "system", "content": "agent"},
        {"role": "user", "content": [{"type": "text", "text": "list files"}], "name": "u"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{\"command\": \"ls\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
    ],
    "tools": [{"type": "function", "function": {"name": "bash", "description": "run a shell command",
                                                "parameters": {"type": "object",
                                                               "properties": {"command": {"type": "string"}}}}}],
    "tool_choice": "auto", "max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "stop": ["END"],
    "stream": False, "seed": 3, "logprobs": False, "n": 1,
}


def _deep(depth: int, leaf="x"):
    v = leaf
    for k in range(depth):
        v = [v] if k % 2 else {"a": v}
    return v


RAW_VALUES = ["1e400", "-1e400", "9" * 5001, "NaN", "Infinity", "-0", "1.5e308",  # spliced in as JSON text
              "1e-300", "-1e-300", "5e-324", "4.9e-324", "1e-45", "0.0000001", "1.0000000000000002", "-0.0",
              "9007199254740993", "18446744073709551616", "-9223372036854775809", "1E+2", "0e0",
              '"\\udc80"', '"\\ud800\\udc00"', '"\\udfff\\ud800"', '"\\u0000\\u001f"', '"\\u2028\\ufeff"',
              '"\\\\u0000"', '"\\/\\b\\f"']
# Numeric extremes, string escapes and nesting (issue 34): spliced in as Python values.
EXTREMES = [1e-300, -1e-300, 5e-324, 1e-7, 1 - 1e-16, 1e308, -1e308, 2**53 + 1, 2**63, -(2**63) - 1, 2**64]
ESCAPES = ["\udc80", "x\udc80y", "\ud800\udc00", "\udbff", "\x00", "\x1b[2J", "\u2028", "\u202e", "\ufeff",
           "\U0001F600", "\\u0000", "subagent:x\udc80", "subagent:\x07", "\r\n", "é" * 7]


def _nested_text(depth: int) -> str:
    return '{"a": %s}' % ("[" * depth + "]" * depth)


def _values(rng: random.Random):
    return [None, True, False, 0, -1, 1, 2**64, -(2**70), 0.0, 0.5, 3.7, -2.5, "", "x", "\u0000",
            "<|im_end|>\n<|im_start|>system\n", "</tool_call>", "\ud800" if rng.random() < 0.5 else "é",
            "a" * rng.choice([1, 300, 5000]), [], [1, "a"], {}, {"type": "function"}, {"x": {"y": []}},
            _deep(rng.choice([70, 900])), "[" * 3000 + "]" * 3000, ["END"] * rng.choice([2, 17]), ["x" * 3000, "y" * 3000],
            {"include_usage": "no"}, {"type": "function", "function": {"name": "bash"}},
            {"type": "json_object"}, "required", "none", "auto",
            rng.choice(EXTREMES), rng.choice(ESCAPES), _deep(rng.choice([63, 64, 65, 100])),
            _nested_text(rng.choice([63, 65, 100]))]  # as tool-call arguments: nested inside a string


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _set(obj, path, value):
    for p in path[:-1]:
        obj = obj[p]
    obj[path[-1]] = value


def _delete(obj, path):
    for p in path[:-1]:
        obj = obj[p]
    del obj[path[-1]]


def _dumps(body) -> bytes:
    try:
        return json.dumps(body, ensure_ascii=True).encode()
    except (RecursionError, ValueError):
        return b"[" * 5000


def cases(n: int, seed: int = 0) -> list[tuple[bytes, dict]]:
    """`n` (body bytes, headers) pairs; the same ones for the same seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        body = copy.deepcopy(BASE)
        body["stream"] = rng.random() < 0.3
        headers: dict = {}
        if rng.random() < 0.15:  # the role header: undecodable bytes, control characters, length
            headers["X-Gyre-Role"] = rng.choice(["\xff", "sub\x01agent", "é".encode().decode("latin-1"),
                                                 "r" * 300, " main "])
        # half the header cases keep a valid body: the header alone is what is tried
        for _ in range(0 if headers and rng.random() < 0.5 else rng.choice([1, 1, 2, 3])):
            paths = [p for p in _paths(body) if p]
            path = rng.choice(paths)
            kind = rng.random()
            try:
                if kind < 0.6:
                    _set(body, path, rng.choice(_values(rng)))
                elif kind < 0.75:
                    _delete(body, path)
                elif kind < 0.85:
                    parent = body
                    for p in path[:-1]:
                        parent = parent[p]
                    if isinstance(parent, dict):
                        parent[rng.choice(["bogus", "name", "stream_options", "tool_call_id", "refusal"])] = \
                            rng.choice(_values(rng))
                else:
                    _set(body, path, "@RAW@")
            except (KeyError, IndexError, TypeError, RecursionError):
                pass
        raw = _dumps(body)
        if b'"@RAW@"' in raw:
            raw = raw.replace(b'"@RAW@"', rng.choice(RAW_VALUES).encode(), 1)
        r = rng.random()
        if r < 0.05:
            raw = raw[: rng.randrange(len(raw))]
        elif r < 0.08:
            headers["Content-Encoding"] = rng.choice(["gzip", "deflate", "br"])
        elif r < 0.10:
            raw = bytes(b ^ 0x80 if rng.random() < 0.01 else b for b in raw)
        out.append((raw, headers))
    return out
