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


class _Watch:
    """Knuth-Morris-Pratt over a growing text for one watched string: fed only the new
    characters, it knows where the string first occurs and how long a prefix of it the text ends
    with. Per streamed token this costs the new characters, not the text so far times the
    watched length (16 stop strings of 10,000 characters re-checked from scratch on every token
    held the event loop for seconds)."""

    def __init__(self, word: str):
        self.word = word
        fail = [0] * len(word)
        k = 0
        for i in range(1, len(word)):
            while k and word[i] != word[k]:
                k = fail[k - 1]
            if word[i] == word[k]:
                k += 1
            fail[i] = k
        self.fail = fail
        self.state = 0  # length of the longest prefix of word the text fed so far ends with
        self.found: int | None = None  # index of the first occurrence in the text, once seen
        self.fed = 0  # characters fed so far

    def feed(self, chars: str) -> None:
        word, fail, k = self.word, self.fail, self.state
        for ch in chars:
            while k and ch != word[k]:
                k = fail[k - 1]
            if ch == word[k]:
                k += 1
            self.fed += 1
            if k == len(word):
                if self.found is None:
                    self.found = self.fed - len(word)
                k = fail[k - 1]
        self.state = k

    def partial(self) -> int:
        """The longest tail of the text that is a proper prefix of the word."""
        k = self.state
        while k >= len(self.word):
            k = self.fail[k - 1]
        return k


class ContentStream:
    def __init__(self, stop: list[str], tools_enabled: bool):
        self.stop = list(stop)
        self.tools = tools_enabled
        self.watch = tuple(self.stop) + _END_TOKENS + ((TOOL_CALL_OPEN,) if tools_enabled else ())
        self._stops = [_Watch(s) for s in self.stop]
        self._tool = _Watch(TOOL_CALL_OPEN) if tools_enabled else None
        self._others = [_Watch(w) for w in _END_TOKENS]
        self._stable = ""  # the output text fed to the watchers (never changes once fed)
        self._final: str | None = None  # the visible content once a stop or a tool call cut it
        self.sent = ""
        self.closed = False  # a tool call began: no more content until the end

    def _advance(self, text: str) -> None:
        # Only a trailing incomplete UTF-8 character (decoded as U+FFFD) can still change.
        stable = text.rstrip("\ufffd")
        if not stable.startswith(self._stable):  # not expected from a decoder; start over
            self.__init__(self.stop, self.tools)
        new = stable[len(self._stable):]
        for w in self._all():
            w.feed(new)
        self._stable = stable

    def _all(self):
        return [*self._stops, *self._others, *([self._tool] if self._tool else [])]

    def visible(self, text: str) -> str:
        """The part of the output text so far that is surely content."""
        if self._final is not None:
            return self._final
        self._advance(text)
        text = self._stable
        hits = [w.found for w in self._stops if w.found is not None]
        cut = min(hits) if hits else None
        if self._tool is not None and self._tool.found is not None and (cut is None or self._tool.found < cut):
            self.closed = True
            cut = self._tool.found
        if cut is not None:  # final from here on: the slow tail check runs once
            self._final = self._clean(text[:cut], _partial_suffix(text[:cut], self.watch))
            return self._final
        return self._clean(text, max((w.partial() for w in self._all()), default=0))

    def _clean(self, text: str, hold: int) -> str:
        text = strip_end_tokens(text[: len(text) - hold])
        return text.rstrip() if self.tools else text
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
