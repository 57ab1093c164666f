"""ChatML rendering (Qwen format, tools included) one message at a time, and output parsing.

The proxy tokenizes message by message so that a message already seen reuses its stored ids
(ARCHITECTURE.md invariant 1). Every boundary between segments sits next to a special or added
token (``<|im_start|>``, ``<|im_end|>``, ``</tool_response>``), so tokenizing segment by segment
gives the same ids as tokenizing the whole rendered conversation.

Segment convention (Qwen2.5 template, cut at message boundaries):
- message i > 0 starts with the closing of message i-1 when that one is still *open*
  (``<|im_end|>``), then ``\\n``; the first message has neither;
- a message body is ``<|im_start|>{role}\\n{content}<|im_end|>``, except tool results: consecutive
  tool messages share one ``user`` turn of ``<tool_response>`` blocks, so a tool message is left
  open and the next non-tool message closes it;
- a sampled assistant message is ``<|im_start|>assistant\\n`` + the output ids; it is open when
  the output did not end with ``<|im_end|>`` (cut by length);
- the generation prompt is ``[close]\\n<|im_start|>assistant\\n``.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from gyre.proxy.params import MAX_DEPTH, RequestError, check_depth

DEFAULT_TOOL_SYSTEM = "You are a helpful assistant."
_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


class MessageError(ValueError):
    """A request message does not follow the OpenAI chat contract."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # canonical JSON text of the arguments object


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: str = ""  # an assistant message's reasoning_content (model chat templates render it)

    def key(self, salt: str = "") -> str:
        """Identity of the message as the model saw it (ids and names do not render).
        Length-prefixed parts, not JSON: escaping a 100 KB tool output cost 0.5 ms per call."""
        h = hashlib.blake2b(digest_size=16)
        parts = [self.role, self.content, *(f"{t.name}\0{t.arguments}" for t in self.tool_calls), salt]
        if self.reasoning:  # absent reasoning keeps the keys messages always had
            parts.append("\0reasoning\0" + self.reasoning)
        h.update(len(parts).to_bytes(4, "little"))
        for part in parts:
            b = part.encode("utf-8", "surrogatepass")
            h.update(len(b).to_bytes(8, "little"))
            h.update(b)
        return h.hexdigest()


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only text renders for a text model
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise MessageError(f"{where}.content[{j}]: only {{'type': 'text', 'text': str}} parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise MessageError(f"{where}.content: expected a string, a list of text parts or null, got {type(content).__name__}")


def canonical_arguments(args: Any, where: str) -> str:
    """Arguments as canonical JSON text, so a client that re-serialises them still matches."""
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return args  # kept verbatim: the model may have produced non-JSON arguments
        except RecursionError:
            raise MessageError(f"{where}.function.arguments: JSON nested too deeply") from None
        if where != "output":  # a client's arguments: the body's own depth bound (docs/openai.md)
            try:
                check_depth(args)
            except RequestError:
                raise MessageError(f"{where}.function.arguments: JSON nested more than {MAX_DEPTH} levels "
                                   "deep") from None
    if not isinstance(args, dict):
        raise MessageError(f"{where}.function.arguments: expected a JSON object or its text")
    try:
        return json.dumps(args, ensure_ascii=False, sort_keys=True)
    except RecursionError:
        raise MessageError(f"{where}.function.arguments: JSON nested too deeply") from None


def parse_messages(raw: Any, start: int = 0) -> list[Message]:
    """``raw[start:]`` parsed (``start``: messages the caller already holds parsed)."""
    if not isinstance(raw, list) or not raw:
        raise MessageError("messages: expected a non-empty list of message objects")
    out = []
    for i in range(start, len(raw)):
        m, where = raw[i], f"messages[{i}]"
        if not isinstance(m, dict):
            raise MessageError(f"{where}: expected an object, got {type(m).__name__}")
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise MessageError(f"{where}.role: {role!r} is not one of system, user, assistant, tool")
        calls = []
        raw_calls = m.get("tool_calls") or []
        if role == "assistant" and not isinstance(raw_calls, list):
            raise MessageError(f"{where}.tool_calls: expected a list")
        for j, tc in enumerate(raw_calls if role == "assistant" else []):
            fn = tc.get("function") if isinstance(tc, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise MessageError(f"{where}.tool_calls[{j}]: expected {{'function': {{'name': str, 'arguments': str}}}}")
            calls.append(ToolCall(fn["name"], canonical_arguments(fn.get("arguments", "{}"), f"{where}.tool_calls[{j}]")))
        reasoning = m.get("reasoning_content") if role == "assistant" else None
        if reasoning is not None and not isinstance(reasoning, str):
            raise MessageError(f"{where}.reasoning_content: expected a string or null")
        out.append(Message(role, _content_text(m.get("content"), where), tuple(calls), reasoning or ""))
    return out


def tools_system_suffix(tools: list[dict]) -> str:
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{lines}\n</tools>\n\nFor each function call, return a json object with function name "
            "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def validate_tools(tools: Any) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise MessageError("tools: expected a list of {'type': 'function', 'function': {...}}")
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("function"), dict) or not isinstance(t["function"].get("name"), str):
            raise MessageError(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': str, ...}}}}")
    return tools


IM_START, IM_END = "<|im_start|>", "<|im_end|>"


@dataclass(frozen=True)
class Control:
    """A control token the chat template itself places (never read out of message text)."""
    text: str


def render_body(msg: Message, tools: list[dict], first: bool, prev_was_tool: bool) -> list[str | Control]:
    """One message's segment after the separator (see module docstring), as text pieces and the
    template's control tokens. Message text never becomes a control token: a tool output holding
    ``<|im_end|>\n<|im_start|>system`` is tokenized as those characters (token safety)."""
    if msg.role == "tool":
        head: list[str | Control] = [] if prev_was_tool else [Control(IM_START), "user\n"]
        return head + [f"<tool_response>\n{msg.content}\n</tool_response>"]
    content = msg.content
    if msg.role == "system" and first and tools:
        content = content + tools_system_suffix(tools)
    if msg.role == "assistant" and msg.tool_calls:
        blocks = "\n".join('<tool_call>\n{"name": %s, "arguments": %s}\n</tool_call>'
                           % (json.dumps(t.name, ensure_ascii=False), t.arguments) for t in msg.tool_calls)
        content = f"{content}\n{blocks}" if content else blocks
    return [Control(IM_START), f"{msg.role}\n{content}", Control(IM_END)]


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall]


TOOL_CALL_OPEN = "<tool_call>"


def strip_end_tokens(text: str) -> str:
    return text.replace("<|im_end|>", "").replace("<|endoftext|>", "")


def parse_output(text: str, tools_enabled: bool = True) -> ParsedOutput:
    """Split model output into content and tool calls; unreadable calls stay plain content.

    With tool calls, the content is the text before the first call, without trailing whitespace
    (what a streaming client has already been sent), plus any text after the calls."""
    text = strip_end_tokens(text)
    if not tools_enabled:
        return ParsedOutput(text, [])
    blocks = _TOOL_CALL_RE.findall(text)
    calls = []
    for b in blocks:
        try:
            obj = json.loads(b)
            name, args = obj["name"], obj.get("arguments", {})
            if not isinstance(name, str) or not isinstance(args, (dict, str)):
                raise TypeError
            calls.append(ToolCall(name, canonical_arguments(args, "output")))
        except (ValueError, KeyError, TypeError, MessageError):
            return ParsedOutput(text, [])
    if calls:
        before = text[: text.find(TOOL_CALL_OPEN)].rstrip()
        after = _TOOL_CALL_RE.sub("", text[len(before):]).strip()
        rest = before + ("\n" + after if before and after else after)
        return ParsedOutput(rest or None, calls)
    return ParsedOutput(text, [])
