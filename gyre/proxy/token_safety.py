"""Token safety of a request, checked once before anything is rendered.

Message text, tool descriptions, tool parameters and function-call arguments are rendered as
plain text (`Renderer.encode_text`), so a control string in them stays characters. Names are
different: a function name is placed into the template itself (the tool list, a forced
``tool_choice`` prefix, the model's own ``<tool_call>`` output it must reproduce), so a name that
holds a token of the template (``<|im_end|>``, ``</tool_call>``, ...) is refused with a 400 naming
the field. OpenAI itself allows only ``[A-Za-z0-9_-]`` in function names.
"""

from __future__ import annotations

from typing import Any, Iterable

from gyre.proxy.params import RequestError


def template_tokens(tokenizer) -> tuple[str, ...]:
    """Every added token of the tokenizer (control and template tokens alike)."""
    return tuple(sorted({t.content for t in tokenizer.get_added_tokens_decoder().values() if t.content}))


def _names(body: dict, start: int = 0) -> Iterable[tuple[str, Any]]:
    """(field, value) of every name the request carries (messages from ``start`` on)."""
    for i, t in enumerate(body.get("tools") or [] if isinstance(body.get("tools"), list) else []):
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict):
            yield f"tools[{i}].function.name", fn.get("name")
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        yield "tool_choice.function.name", choice["function"].get("name")
    messages = body.get("messages")
    messages = messages if isinstance(messages, list) else []
    for i in range(start, len(messages)):
        m = messages[i]
        if not isinstance(m, dict):
            continue
        yield f"messages[{i}].name", m.get("name")
        calls = m.get("tool_calls")
        for j, tc in enumerate(calls if isinstance(calls, list) else []):
            fn = tc.get("function") if isinstance(tc, dict) else None
            if isinstance(fn, dict):
                yield f"messages[{i}].tool_calls[{j}].function.name", fn.get("name")


def check_names(body: dict, tokens: tuple[str, ...], start: int = 0) -> None:
    """Refuse a name holding a template token (400, naming the field and the token); messages
    before ``start`` were checked already (an earlier call of the execution sent them)."""
    for where, name in _names(body, start):
        if isinstance(name, str):
            hit = next((t for t in tokens if t in name), None)
            if hit is not None:
                raise RequestError(400, f"{where}: {name[:80]!r} contains {hit!r}, a token of the chat template; "
                                        "function and message names may not hold template tokens (OpenAI allows "
                                        "letters, digits, '_' and '-')", param=where.split("[")[0])
