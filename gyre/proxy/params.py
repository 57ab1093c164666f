"""OpenAI chat-completion parameters: each one is honoured, approximated or refused with a 400.

Nothing is ignored silently: a parameter the proxy cannot honour for a value a client actually
sets is refused with a message naming it (docs/openai.md has the table).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


class RequestError(Exception):
    """An OpenAI-shaped error: ``status``, ``message``, ``type``, ``code`` (string or None), ``param``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param


MAX_TOP_LOGPROBS = 20
# Stop strings are matched on every streamed token, in the proxy and in the engine, for everyone
# sharing them: their number and total length are bounded so one call cannot slow the others.
MAX_STOP_STRINGS = 16
MAX_STOP_TOTAL_CHARS = 4096
STREAM_OPTIONS = {"include_usage", "include_obfuscation"}  # obfuscation pads chunks: nothing to do here
SEED_RANGE = (-(2**63), 2**64 - 1)
MIN_TOP_P = 1e-6  # SGLang's _SAMPLING_EPS; a smaller positive top_p is 0 (or subnormal) in float32

# Accepted and without effect on the generation (bookkeeping for OpenAI's own service).
_BOOKKEEPING = {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}
# Parameters handled below.
_HANDLED = {"model", "messages", "tools", "tool_choice", "parallel_tool_calls", "n", "max_tokens",
            "max_completion_tokens", "stop", "stream", "stream_options", "temperature", "top_p", "seed",
            "logprobs", "top_logprobs", "response_format", "frequency_penalty", "presence_penalty",
            "logit_bias", "functions", "function_call", "reasoning_effort", "modalities", "audio", "prediction",
            "web_search_options"}
KNOWN = _BOOKKEEPING | _HANDLED


@dataclass
class CallParams:
    max_new_tokens: int
    temperature: float
    top_p: float
    stop: list[str]
    stream: bool
    include_usage: bool
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    tool_choice: str = "auto"  # none | auto | required | function
    tool_name: str | None = None  # the named function, for tool_choice == "function"
    explicit_max: bool = field(default=False, repr=False)
    # what the harness asked for where the sampling policy changed it ({"temperature": t, "top_p": p})
    requested: dict | None = None


MAX_DEPTH = 64  # JSON nesting a request may have (Python's own recursion fails near 1,000)


def check_depth(value: Any, limit: int = MAX_DEPTH) -> None:
    """Refuse JSON nested deeper than `limit` (walked without recursion), before anything
    recursive (rendering, canonical JSON) meets it."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        if d > limit:
            raise RequestError(400, f"request body is nested more than {limit} levels deep")
        stack.extend((x, d + 1) for x in v)


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise RequestError(400, f"{name}: expected a number in [{lo}, {hi}], got {v!r}", param=name)
    return float(v)


def _off(body: dict, name: str, off_values: tuple, why: str) -> None:
    v = body.get(name)
    if v is not None and v not in off_values:
        raise RequestError(400, f"{name}={json.dumps(v)[:80]} is not supported: {why}", param=name)


def parse_params(body: dict, tools: list[dict], default_max: int, cap: int) -> CallParams:
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise RequestError(400, f"Unrecognized request argument(s) supplied: {', '.join(unknown)}", param=unknown[0])
    n = body.get("n", 1)
    if n not in (1, None):
        raise RequestError(400, f"n: only n=1 is supported (got {n!r}); send n separate requests instead", param="n")
    mt, explicit = _max_tokens(body, default_max)
    stop = _stop(body)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError(400, f"stream: expected true or false, got {stream!r}", param="stream")
    include_usage = _stream_options(body.get("stream_options"), stream)
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
            raise RequestError(400, f"seed: expected an integer in [-2**63, 2**64 - 1], got {str(seed)[:40]}", param="seed")
        seed %= 2**64
    logprobs = body.get("logprobs") or False
    if not isinstance(logprobs, bool):
        raise RequestError(400, f"logprobs: expected true or false, got {logprobs!r}", param="logprobs")
    top = body.get("top_logprobs")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise RequestError(400, f"top_logprobs: expected an integer in [0, {MAX_TOP_LOGPROBS}], got {top!r}",
                               param="top_logprobs")
        if top and not logprobs:
            raise RequestError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
    _refuse_unsupported(body)
    pt = body.get("parallel_tool_calls")
    if pt is not None and not isinstance(pt, bool):
        raise RequestError(400, f"parallel_tool_calls: expected true or false, got {pt!r}", param="parallel_tool_calls")
    choice, name = _tool_choice(body.get("tool_choice"), tools)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if 0.0 < top_p < MIN_TOP_P:  # rounds to 0 in the engine's float32: every token filtered, NaN sampling
        raise RequestError(400, f"top_p: {top_p!r} is below the smallest value served ({MIN_TOP_P}); send 0 for "
                                "greedy decoding or a value in [1e-6, 1]", param="top_p")
    if top_p == 0.0:  # OpenAI: only the most likely token is kept, i.e. greedy decoding
        temperature, top_p = 0.0, 1.0
    return CallParams(
        max_new_tokens=min(mt, cap),
        temperature=temperature,
        top_p=top_p,
        stop=stop, stream=stream, include_usage=include_usage,
        seed=seed, logprobs=logprobs, top_logprobs=top or 0, tool_choice=choice, tool_name=name,
        explicit_max=explicit)


def _max_tokens(body: dict, default_max: int) -> tuple[int, bool]:
    """max_completion_tokens (or max_tokens), and whether the client sent one."""
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    if isinstance(mt, int) and not isinstance(mt, bool) and mt > 2**62:
        mt = 2**62  # any larger value means the same (clamped to the cap); keeps the int small
    explicit = mt is not None
    if mt is None:
        mt = default_max
    if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
        raise RequestError(400, f"max_tokens: expected a positive integer, got {mt!r}", param="max_tokens")
    return mt, explicit


def _stop(body: dict) -> list[str]:
    """The stop strings, bounded in number and length (they are matched on every token)."""
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP_STRINGS:
        raise RequestError(400, f"stop: expected a non-empty string or a list of up to {MAX_STOP_STRINGS} "
                                "non-empty strings", param="stop")
    if sum(map(len, stop)) > MAX_STOP_TOTAL_CHARS:
        raise RequestError(400, f"stop: the stop strings hold {sum(map(len, stop))} characters in all; at most "
                                f"{MAX_STOP_TOTAL_CHARS} are allowed", param="stop")
    return stop


def _refuse_unsupported(body: dict) -> None:
    """Parameters the proxy cannot honour, refused for any value a client actually sets."""
    _off(body, "frequency_penalty", (0, 0.0), "the engine samples without penalties; leave it out or send 0")
    _off(body, "presence_penalty", (0, 0.0), "the engine samples without penalties; leave it out or send 0")
    if body.get("logit_bias"):
        raise RequestError(400, "logit_bias is not supported: it would change the sampled distribution "
                                "the trainer must reproduce", param="logit_bias")
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise RequestError(400, "functions/function_call (deprecated) are not supported; use tools and tool_choice",
                           param="functions")
    _off(body, "modalities", (["text"],), "this model produces text only")
    for name in ("audio", "prediction", "web_search_options"):
        _off(body, name, (), "not available for this model")
    _off(body, "reasoning_effort", (), "this model has no reasoning control")
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind != "text":
            raise RequestError(400, f"response_format {json.dumps(fmt)[:80]} is not supported: the engine has no "
                                    "constrained decoding; ask for JSON in the prompt instead (only "
                                    "{\"type\": \"text\"} is accepted)", param="response_format")


def _stream_options(opts: Any, stream: bool) -> bool:
    """``stream_options`` as OpenAI checks it: only with ``stream: true``, known keys, booleans.
    Returns include_usage."""
    if opts is None:
        return False
    if not stream:
        raise RequestError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if not isinstance(opts, dict):
        raise RequestError(400, "stream_options: expected an object like {\"include_usage\": true}", param="stream_options")
    unknown = sorted(set(opts) - STREAM_OPTIONS)
    if unknown:
        raise RequestError(400, f"stream_options: unknown key(s) {', '.join(map(repr, unknown))[:200]}; "
                                f"known: {', '.join(sorted(STREAM_OPTIONS))}", param="stream_options")
    for key, value in opts.items():
        if value is not None and not isinstance(value, bool):
            raise RequestError(400, f"stream_options.{key}: expected true or false, got {json.dumps(value)[:40]}",
                               param="stream_options")
    return bool(opts.get("include_usage"))


def _tool_choice(raw: Any, tools: list[dict]) -> tuple[str, str | None]:
    if raw is None:
        return ("auto", None)
    if raw in ("none", "auto", "required"):
        if raw != "none" and not tools:
            raise RequestError(400, f"tool_choice {raw!r} is only allowed when tools are specified", param="tool_choice")
        return (raw, None)
    fn = raw.get("function") if isinstance(raw, dict) and raw.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError(400, "tool_choice: expected 'none', 'auto', 'required' or "
                                "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
    names = [t["function"]["name"] for t in tools]
    if fn["name"] not in names:
        raise RequestError(400, f"tool_choice names function {fn['name']!r}, which is not in tools {names}",
                           param="tool_choice")
    return ("function", fn["name"])


def forced_prefix(p: CallParams) -> str:
    """Assistant text placed before sampling so the model must call a tool (Qwen's format).
    These tokens are context, not samples: they are recorded as prompt, never trained."""
    if p.tool_choice == "required":
        return "<tool_call>\n"
    if p.tool_choice == "function":
        return '<tool_call>\n{"name": %s, "arguments": ' % json.dumps(p.tool_name, ensure_ascii=False)
    return ""

