"""Tool-call and reasoning parsers, selected by name (as SGLang's ``--tool-call-parser`` and
``--reasoning-parser`` are): they read the model's output text into OpenAI fields and never
change the sampled tokens (what trains is the ids; these only shape the reply).

Tool-call parsers (`TOOL_PARSERS`):
* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5, Qwen3).
* ``qwen3_coder``: Qwen3-Coder's XML function format,
  ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>``;
  a VALUE that is valid JSON is taken as JSON, else as a string.
* ``llama3``: Llama 3.x's JSON calls, ``{"name": ..., "parameters": {...}}`` (``arguments`` also
  read), the whole output, optionally after ``<|python_tag|>``, several separated by ``;``.
A block that does not parse leaves the whole output as plain content (never a half-read call).

Reasoning parsers (`REASONING_PARSERS`): ``qwen3`` splits ``<think>...</think>`` off the front
into ``reasoning_content`` (an unclosed ``<think>`` is all reasoning: the reply was cut);
``none`` keeps everything as content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: dict


@dataclass
class Parsed:
    content: str | None
    tool_calls: list[ParsedCall]
    reasoning_content: str | None = None


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_XML_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.S)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def _content_around(text: str, pattern: re.Pattern) -> str | None:
    first = pattern.search(text)
    before = text[: first.start()].rstrip() if first else text
    after = pattern.sub("", text[first.start():]).strip() if first else ""
    rest = before + ("\n" + after if before and after else after)
    return rest or None


def parse_hermes(text: str) -> Parsed:
    calls = []
    for block in _HERMES.findall(text):
        try:
            obj = json.loads(block)
            name, args = obj["name"], obj.get("arguments", {})
            if isinstance(args, str):
                args = json.loads(args)
            if not isinstance(name, str) or not isinstance(args, dict):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            return Parsed(text, [])
        calls.append(ParsedCall(name, args))
    return Parsed(_content_around(text, _HERMES), calls) if calls else Parsed(text, [])


def _xml_value(raw: str):
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def parse_qwen3_coder(text: str) -> Parsed:
    if text.count("<tool_call>") != len(_XML_CALL.findall(text)):
        return Parsed(text, [])  # an unreadable block: all of it is content
    calls = [ParsedCall(name.strip(), {k.strip(): _xml_value(v) for k, v in _XML_PARAM.findall(body)})
             for name, body in _XML_CALL.findall(text)]
    return Parsed(_content_around(text, _XML_CALL), calls) if calls else Parsed(text, [])


_PYTHON_TAG = "<|python_tag|>"


def parse_llama3(text: str) -> Parsed:
    body = text.strip()
    body = body[len(_PYTHON_TAG):].lstrip() if body.startswith(_PYTHON_TAG) else body
    if not body.startswith("{"):
        return Parsed(text, [])
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            obj, at = decoder.raw_decode(body, at)
            name = obj["name"]
            args = obj["parameters"] if "parameters" in obj else obj.get("arguments", {})
            args = json.loads(args) if isinstance(args, str) else args
            if not isinstance(name, str) or not isinstance(args, dict):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            return Parsed(text, [])
        calls.append(ParsedCall(name, args))
        at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
    return Parsed(None, calls)


def parse_none(text: str) -> Parsed:
    return Parsed(text, [])


TOOL_PARSERS = {"hermes": parse_hermes, "qwen3_coder": parse_qwen3_coder, "llama3": parse_llama3, "none": parse_none}


def split_reasoning_qwen3(text: str) -> tuple[str | None, str]:
    """(reasoning, rest) of an output that may open with ``<think>`` (or, as Qwen3 templates that
    put ``<think>`` in the generation prompt make it, with only the closing ``</think>``)."""
    start = text.find("<think>")
    if start != -1 and not text[:start].strip():
        body = text[start + len("<think>"):]
    elif "</think>" in text:
        body = text
    else:
        return None, text
    end = body.find("</think>")
    if end == -1:
        return body.strip() or None, ""
    return body[:end].strip() or None, body[end + len("</think>"):].lstrip("\n")


REASONING_PARSERS = {"qwen3": split_reasoning_qwen3, "none": lambda text: (None, text)}


def parse(text: str, tool_parser: str = "hermes", reasoning_parser: str = "none",
          tools_enabled: bool = True) -> Parsed:
    """Reasoning first (tool calls inside the reasoning are thoughts, not calls), then tool calls."""
    for kind, table, name in (("tool_parser", TOOL_PARSERS, tool_parser),
                              ("reasoning_parser", REASONING_PARSERS, reasoning_parser)):
        if name not in table:
            raise ValueError(f"{kind} {name!r}: choose one of {', '.join(sorted(table))}")
    reasoning, rest = REASONING_PARSERS[reasoning_parser](text)
    out = TOOL_PARSERS[tool_parser if tools_enabled else "none"](rest)
    out.reasoning_content = reasoning
    if not out.content:
        out.content = None  # OpenAI: null content, not an empty string
    return out
