"""Content deltas for a streamed chat completion, sent as the engine produces tokens.

What has been sent must stay a prefix of the content the finished call reports (and records),
or the harness's copy of the message would differ from the proxy's and its stored ids could not
be reused. So a text tail is held back while it could still turn into something that is not
content: the start of a stop string, of ``<tool_call>``, of an end token, an incomplete UTF-8
character, or (with tools) trailing whitespace that a following tool call would strip.
"""

from __future__ import annotations

from gyre.proxy.chat import TOOL_CALL_OPEN, strip_end_tokens

_END_TOKENS = ("<|im_end|>", "<|endoftext|>")


def _partial_suffix(text: str, watch: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a watched string."""
    best = 0
    for w in watch:
        for k in range(min(len(w) - 1, len(text)), best, -1):
            if text.endswith(w[:k]):
                best = k
                break
    return best


class ContentStream:
    def __init__(self, stop: list[str], tools_enabled: bool):
        self.stop = list(stop)
        self.tools = tools_enabled
        self.watch = tuple(self.stop) + _END_TOKENS + ((TOOL_CALL_OPEN,) if tools_enabled else ())
        self.sent = ""
        self.closed = False  # a tool call began: no more content until the end

    def visible(self, text: str) -> str:
        """The part of the output text so far that is surely content."""
        hits = [text.find(s) for s in self.stop if s in text]
        if hits:
            text = text[: min(hits)]
        if self.tools and TOOL_CALL_OPEN in text:
            self.closed = True
            text = text[: text.find(TOOL_CALL_OPEN)]
        text = text.rstrip("\ufffd")
        text = text[: len(text) - _partial_suffix(text, self.watch)]
        text = strip_end_tokens(text)
        if self.tools:
            text = text.rstrip()
        return text

    def delta(self, text: str) -> str:
        """New content to send for the output text so far ('' when nothing new is certain)."""
        if self.closed:
            return ""
        vis = self.visible(text)
        if len(vis) <= len(self.sent) or not vis.startswith(self.sent):
            return ""
        out, self.sent = vis[len(self.sent):], vis
        return out

    def rest(self, final_content: str | None) -> str:
        """What is left to send once the call's final content is known."""
        final = final_content or ""
        return final[len(self.sent):] if final.startswith(self.sent) else ""


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ReasoningStream:
    """Deltas for a reasoning parser (``proxy.reasoning_parser = "qwen3"``): while the output is
    inside ``<think>...</think>``, ``reasoning_content`` deltas; after it, content deltas through a
    `ContentStream`. Like content, what is sent stays a prefix of what the finished call reports
    (a partial ``</think>`` is held back). An output that does not open with ``<think>`` streams as
    content (a template that opens the block in its generation prompt is not split while
    streaming)."""

    def __init__(self, content: ContentStream):
        self.content = content
        self.sent = ""

    def deltas(self, text: str) -> dict:
        body = text.lstrip()
        if not body.startswith(THINK_OPEN):
            if THINK_OPEN.startswith(body):
                return {}  # could still become "<think>"
            return {"content": self.content.delta(text)}
        inner = body[len(THINK_OPEN):]
        end = inner.find(THINK_CLOSE)
        out = {}
        if end < 0:
            seen = inner[: len(inner) - _partial_suffix(inner, (THINK_CLOSE,))].lstrip()
        else:
            seen = inner[:end].strip()
            after = inner[end + len(THINK_CLOSE):].lstrip("\n")
            c = self.content.delta(after)
            if c:
                out["content"] = c
        seen = seen.rstrip("\ufffd")
        if end < 0:
            seen = seen.rstrip()  # the final reasoning is stripped: never send what may go
        if seen.startswith(self.sent) and len(seen) > len(self.sent):
            out["reasoning_content"], self.sent = seen[len(self.sent):], seen
        return out

    def rest(self, final_reasoning: str | None) -> str:
        final = final_reasoning or ""
        return final[len(self.sent):] if final.startswith(self.sent) else ""
