"""The model directory's own chat template (Jinja), rendered as transformers'
``apply_chat_template`` renders it, plus what the proxy needs on top: per-message deltas (so stored
ids of messages already seen are reused) and a conformance probe (is the template append-only?).

Where the template comes from: ``chat_template.jinja`` in the directory, else the
``chat_template`` of ``tokenizer_config.json`` (a string, or a list of ``{name, template}`` of
which "default" is used). The Jinja environment is transformers' (sandboxed, ``trim_blocks``,
``lstrip_blocks``, ``raise_exception``, a ``tojson`` that keeps non-ASCII).

Segments: message i's text runs from where message i-1's text became final to where its own does
(`ChatTemplate.stable_end`: the part of the render that no following message nor the generation
prompt changes), cut from the render of the whole conversation, so a template that closes a turn
only when the next message is known still cuts into segments whose concatenation is exactly
``apply_chat_template``'s prompt. Cost: a few renders of the conversation per new message.
`conformance` says whether sampled turns survive later renders (append-only).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from gyre.model.families import ModelFormatError


class TemplateError(ModelFormatError):
    """The chat template cannot be loaded or rendered (the message names the step)."""


def load_chat_template(model_dir: str | Path) -> str | None:
    """The directory's chat template source, or None when it has none."""
    d = Path(model_dir)
    jinja = d / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(encoding="utf-8")
    cfg = d / "tokenizer_config.json"
    if not cfg.exists():
        return None
    try:
        tpl = json.loads(cfg.read_text(encoding="utf-8")).get("chat_template")
    except json.JSONDecodeError as e:
        raise TemplateError(f"{cfg}: unreadable JSON ({e})") from None
    if isinstance(tpl, list):
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default")
    return tpl if isinstance(tpl, str) else None


def _environment():
    from jinja2.exceptions import TemplateError as JinjaError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise JinjaError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


# What may follow a message: one stand-in per role (only used to find where a message's text is
# final, i.e. the same whatever comes next).
_NEXT = [{"role": "user", "content": "U"}, {"role": "tool", "content": "T"},
         {"role": "assistant", "content": "A"}]


def _common(a: str, b: str) -> int:
    """Length of the common prefix (binary search over slice comparisons: C speed on long text)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass
class ChatTemplate:
    source: str
    _compiled: object = field(default=None, repr=False)

    def __post_init__(self):
        from jinja2 import TemplateSyntaxError

        try:
            self._compiled = _environment().from_string(self.source)
        except TemplateSyntaxError as e:
            raise TemplateError(f"chat template does not compile: {e}") from None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ChatTemplate | None":
        src = load_chat_template(model_dir)
        return cls(src) if src else None

    def render(self, messages: list[dict], tools: list[dict] | None = None, *,
               add_generation_prompt: bool = False, **kwargs) -> str:
        from jinja2.exceptions import TemplateError as JinjaError

        try:
            return self._compiled.render(messages=messages, tools=tools or None,
                                         add_generation_prompt=add_generation_prompt, **kwargs)
        except JinjaError as e:
            raise TemplateError(f"chat template refused the conversation: {e}") from None

    # --- incremental ------------------------------------------------------------------------
    def stable_end(self, messages: list[dict], tools: list[dict] | None = None) -> int:
        """Length of the text of `messages` that stays the same whatever follows (another message
        of any role, or the generation prompt): where the last message's segment ends. A
        template that closes a tool turn only when a non-tool message follows leaves the closing
        to the next segment, as Gyre's own ChatML renderer does."""
        whole = self.render(messages, tools)
        ends = [_common(whole, self.render(messages, tools, add_generation_prompt=True))]
        for nxt in _NEXT:
            try:
                ends.append(_common(whole, self.render(messages + [nxt], tools)))
            except TemplateError:
                pass  # the template refuses that role here (e.g. tool after user): it cannot follow
        return min(ends)

    def segments(self, messages: list[dict], tools: list[dict] | None = None, start: int = 0,
                 cut: int | None = None) -> tuple[list[str], str]:
        """Texts of messages[start:] as segments (each ends where its text is final) and the
        generation prompt after them, cut from the template's render of the whole conversation.
        Segment `start` begins at text offset `cut` (default: where messages[:start] become
        final). With the default cut, the texts before `start` plus these are exactly the prompt
        transformers' ``apply_chat_template(..., add_generation_prompt=True)`` gives."""
        prompt = self.render(messages, tools, add_generation_prompt=True)
        if cut is None:
            cut = self.stable_end(messages[:start], tools) if start else 0
        out = []
        for i in range(start, len(messages)):
            # the last message too: what only the generation prompt closes (a tool turn) goes into
            # the call's prompt text, as Gyre's built-in renderer puts it
            end = max(self.stable_end(messages[: i + 1], tools), cut)
            out.append(prompt[cut:end])
            cut = end
        return out, prompt[cut:]


PROBE = [  # a conversation with each thing a template may treat specially
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Fix the bug in main.py."},
    {"role": "assistant", "reasoning_content": "I should read the file first.", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": {"command": "cat main.py"}}}]},
    {"role": "tool", "content": "print(1/0)"},
    {"role": "assistant", "reasoning_content": "Division by zero.", "content": "The bug is a division by zero."},
    {"role": "user", "content": "Thanks. Now run the tests."},
    {"role": "assistant", "content": "Running them.",
     "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": {"command": "pytest"}}}]},
    {"role": "tool", "content": "1 passed"},
    {"role": "tool", "content": "done"},
]
PROBE_TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a command",
                                                  "parameters": {"type": "object",
                                                                 "properties": {"command": {"type": "string"}}}}}]


def conformance(template: ChatTemplate, messages: list[dict] | None = None, tools: list[dict] | None = None) -> dict:
    """Render `messages` (default `PROBE`) as the proxy does and say whether token-in/token-out
    capture is exact under this template.

    ``append_only``: for every assistant message, the prompt it was sampled from plus its text
    is a prefix of the whole conversation rendered later (fails where a template rewrites history,
    e.g. drops past reasoning). ``incremental_exact``: the per-message segments concatenate to
    the whole render. ``breaks``: where either fails (message index, role, why)."""
    messages = PROBE if messages is None else messages
    tools = PROBE_TOOLS if tools is None else tools
    whole = template.render(messages, tools)
    breaks = []
    for a, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = template.render(messages[:a], tools, add_generation_prompt=True)
        turn = template.render(messages[: a + 1], tools)
        if not turn.startswith(prompt):
            breaks.append({"message": a, "role": "assistant",
                           "why": "the generation prompt is not how the template opens an assistant turn"})
        elif not whole.startswith(turn.rstrip()):  # the turn as sampled (trailing newlines are the template's)
            breaks.append({"message": a, "role": "assistant",
                           "why": "later messages change how this sampled turn renders (e.g. reasoning dropped)"})
    append_only = not breaks
    try:
        segs, gen = template.segments(messages, tools)
        incremental = "".join(segs) + gen == template.render(messages, tools, add_generation_prompt=True)
        if not incremental:
            breaks.append({"message": None, "role": None, "why": "per-message segments differ from the whole render"})
    except TemplateError as e:
        incremental = False
        breaks.append({"message": None, "role": None, "why": str(e)})
    return {"append_only": append_only, "incremental_exact": incremental, "breaks": breaks}
