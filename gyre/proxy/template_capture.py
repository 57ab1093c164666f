"""Rendering with the model directory's own chat template (`gyre.model.chat_template`), with the
same capture contract as the built-in ChatML path (gyre.proxy.capture): the messages are walked
down the execution's tree, matched messages reuse their stored ids, an assistant message this
proxy sampled reuses its sampled ids, and only new messages are rendered (cut from the template's
render of the conversation into per-message segments) and tokenized.

Templates that are not append-only (a Qwen3-style template drops past reasoning from history)
make two behaviours possible, chosen by ``proxy.history``:

* ``exact`` (default): what the model saw stays what trains. Messages already in the tree keep
  their stored ids even where the template would now render them differently; only new
  messages are rendered. Later calls are conditioned on the sampled history, not the template's.
* ``template``: follow the template. Where its render of an already-seen message differs from
  the stored text, the walk stops and the tree branches there: the rewritten messages become new
  segments (context, not targets), and each target keeps the exact context it was sampled from.

Token safety is kept: the message text inside a segment (content, reasoning) is tokenized as
plain text, only the template's own text can produce control tokens.

Token boundaries: the template is bound to the tokenizer's added tokens (`bind_template`), so
segments are cut only at their edges and tokenizing them one by one gives the ids of tokenizing
the whole prompt. `check_template` proves this at proxy start on probe conversations, by ids, and
refuses a template it cannot follow exactly. A conversation the template itself refuses (its
``raise_exception``) is the client's error: a 400 with the template's reason, never a 500.
"""

from __future__ import annotations

import json
import re

from gyre.config import History
from gyre.model.chat_template import PROBE_TOOLS, PROBES, ChatTemplate, TemplateError, conformance
from gyre.proxy.capture import ExecutionSession, PreparedCall, Renderer, message_keys, tools_salt, walk_start
from gyre.proxy.chat import Message, MessageError
from gyre.traj.tree import ROOT, Segment

HISTORY_MODES = ("exact", "template")
WINDOW = 8  # matched messages a windowed render keeps before the new ones (see prepare_call_template)
BRIDGE_CHARS = 32  # the end of the message before the window that must precede it as stored


class TemplateRefused(ValueError):
    """The model's chat template cannot be followed by token ids (raised at proxy start)."""


def bind_template(r: Renderer, template: ChatTemplate) -> ChatTemplate:
    """Cut `template`'s segments only at the edges of `r`'s added tokens (special or not)."""
    template.bind(t.content for t in r.tok.get_added_tokens_decoder().values() if t.content)
    return template


def check_template(r: Renderer, template: ChatTemplate) -> dict:
    """Bind `template` to `r` and prove on the probe conversations that per-message segments,
    tokenized one by one, give exactly the ids transformers' ``apply_chat_template`` gives for
    the whole prompt. Returns the conformance of the first probe the template renders; raises
    `TemplateRefused` (with the reason) when a probe's ids differ or the template renders none."""
    bind_template(r, template)
    results = [conformance(template, probe, PROBE_TOOLS, encode=r.encode) for probe in PROBES]
    rendered = [c for c in results if not c["refused"]]
    if not rendered:
        raise TemplateRefused("the model's chat template renders none of Gyre's probe conversations ("
                              f"{results[0]['breaks'][0]['why']}); use proxy.chat_template = \"builtin\" "
                              "or a template that renders multi-turn tool conversations")
    for c in rendered:
        if not c["incremental_exact"]:
            why = next(b["why"] for b in c["breaks"] if b["message"] is None)
            raise TemplateRefused(f"the model's chat template cannot be followed by token ids: {why}; Gyre would "
                                  "train on other ids than the engine saw, so it refuses to serve it")
    return rendered[0]


def as_template_message(m: Message) -> dict:
    """A message as chat templates read it (transformers' convention: arguments as objects)."""
    out: dict = {"role": m.role, "content": m.content}
    if m.reasoning:
        out["reasoning_content"] = m.reasoning
    if m.tool_calls:
        calls = []
        for t in m.tool_calls:
            try:
                args = json.loads(t.arguments)
            except ValueError:
                args = t.arguments
            calls.append({"type": "function", "function": {"name": t.name, "arguments": args}})
        out["tool_calls"] = calls
    return out


def _specials(r: Renderer) -> dict[str, int]:
    found = getattr(r, "_gyre_specials", None)
    if found is None:
        found = {t.content: i for i, t in r.tok.get_added_tokens_decoder().items() if t.special}
        r._gyre_specials = found
    return found


def encode_segment(r: Renderer, text: str, plain: list[str]) -> list[int]:
    """`text` tokenized as Gyre's built-in renderer tokenizes its pieces: special tokens the
    template wrote become their ids, everything between them (template text and message text
    together) is tokenized as plain text; special-token strings inside the message pieces
    `plain` (found in order) stay characters."""
    specials = _specials(r)
    spans, pos = [], 0
    for piece in plain:
        at = text.find(piece, pos) if piece else -1
        if at >= 0:
            spans.append((at, at + len(piece)))
            pos = at + len(piece)
    pattern = re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)))
    ids: list[int] = []
    last = 0
    for m in pattern.finditer(text):
        if any(a <= m.start() < b for a, b in spans):
            continue  # inside message text: characters, not a control token
        if m.start() > last:
            ids += r.encode_text(text[last:m.start()])
        ids.append(specials[m.group()])
        last = m.end()
    if last < len(text):
        ids += r.encode_text(text[last:])
    return ids


def _sampled_segment(r: Renderer, text: str, gen_prompt: str, out_ids: list[int]) -> list[int]:
    """A sampled assistant message: its generation prompt, the exact sampled ids, then the
    template's text after the turn (e.g. the newline after the end token)."""
    sampled = r.decode(out_ids)
    body = text[len(gen_prompt):] if text.startswith(gen_prompt) else text
    at = body.find(sampled) if sampled else -1
    tail = body[at + len(sampled):] if at >= 0 else ""
    return encode_segment(r, gen_prompt, []) + list(out_ids) + (encode_segment(r, tail, []) if tail else [])


def _resume_offset(template: ChatTemplate, dicts: list[dict], j: int, tools, stored: str) -> int:
    """Where in the template's prompt the new messages' text starts, after the stored history
    (text `stored`): its end when the template renders the history as stored; otherwise (exact
    history under a template that rewrote it) just after the last stored turn's final text as the
    template now renders it, falling back to where the template's history becomes final."""
    prompt = template.render(dicts, tools, add_generation_prompt=True)
    if prompt.startswith(stored):
        return len(stored)
    tail = stored[-32:]
    bound = template.stable_end(dicts[:j], tools) + len(tail)  # within the history, not the new messages
    at = prompt.rfind(tail, 0, bound) if tail else -1
    return at + len(tail) if at >= 0 else 0  # 0: the caller falls back to the stable end


def _node_text(r: Renderer, session: ExecutionSession, nid: int) -> str:
    """A node's decoded text, decoded once per execution (a node's tokens never change)."""
    text = session.texts.get(nid)
    if text is None:
        text = session.texts[nid] = r.decode(session.tree.nodes[nid].tokens.tolist())
    return text


def _window(r: Renderer, template: ChatTemplate, session: ExecutionSession, dicts: list[dict], matched: list[int],
            tools: list[dict]) -> tuple[list[dict], int, int] | None:
    """The conversation cut to its first message, one bridge message, the last WINDOW matched ones
    and the new ones, when the template renders it as the first message's stored text, then the
    bridge ending as stored, then the matched ones exactly as stored; returns ``(view, base,
    cut)``: message i at view index ``i - base``, the stored text ending at ``cut``. None: render
    the whole conversation. (The bridge's own opening depends on the message before it, which
    the window leaves out, so only its end is compared.)"""
    j = len(matched)
    a = j - WINDOW
    if a < 2:
        return None
    view = dicts[:1] + dicts[a - 1:]
    first = _node_text(r, session, matched[0])
    bridge_end = _node_text(r, session, matched[a - 1])[-BRIDGE_CHARS:]
    stored = "".join(_node_text(r, session, n) for n in matched[a:])
    try:
        prompt = template.render(view, tools, add_generation_prompt=True)
    except TemplateError:
        return None
    at = prompt.find(stored, len(first) + len(bridge_end)) if prompt.startswith(first) else -1
    if at < 0 or not prompt.startswith(bridge_end, at - len(bridge_end)):
        return None
    return view, a - 2, at + len(stored)


def prepare_call_template(r: Renderer, template: ChatTemplate, session: ExecutionSession, messages: list[Message],
                          tools: list[dict], history: str = "exact", keys: list[str] | None = None,
                          same: int = 0, window: bool = False) -> PreparedCall:
    """``keys``/``same`` as for `gyre.proxy.capture.prepare_call` (the leading messages of the
    execution's last walk are taken from it, not walked, converted or decoded again).

    ``window`` (an append-only template, `conformance`): the template renders only the first
    message, the last WINDOW + 1 matched ones and the new ones, as long as it renders those
    matched ones exactly as stored (else the whole conversation, as without): per-call work
    then follows the call's new messages, not the execution so far."""
    if history not in HISTORY_MODES:
        raise ValueError(f"proxy.history {history!r}: choose one of {', '.join(HISTORY_MODES)}")
    if not template.atoms:  # not bound at start (a direct caller): bind to this tokenizer once
        bind_template(r, template)
    try:
        return _prepare(r, template, session, messages, tools, history, keys, same, window)
    except TemplateError as e:  # the template's own rule (e.g. "No user query found"): the request's fault
        raise MessageError(f"messages: {e}") from None


def _prepare(r: Renderer, template: ChatTemplate, session: ExecutionSession, messages: list[Message],
             tools: list[dict], history: str, keys: list[str] | None, same: int, window: bool) -> PreparedCall:
    tree = session.tree
    keys = keys if keys is not None else message_keys(messages, tools_salt(tools))
    walked, known = walk_start(session, same)
    old = walked.dicts if walked is not None and walked.dicts is not None else []
    dicts = old[:min(same, len(old))] + [as_template_message(m) for m in messages[min(same, len(old)):]]
    matched: list[int] = walked.nodes[:known] if known else []
    parent = matched[-1] if known else ROOT
    for key in keys[known:]:
        nid = tree.find_child(parent, key)
        if nid is None:
            break
        matched.append(nid)
        parent = nid
    cut_view = _window(r, template, session, dicts, matched, tools) if window else None
    # a window that did not hold: this conversation renders whole (the proxy prepares the next
    # call of it off the loop when it is long, gyre.proxy.server.Proxy._fresh_chars)
    session.renders_whole = window and cut_view is None and len(matched) - WINDOW >= 2
    if cut_view is not None:
        view, base, cut = cut_view
    else:
        view, base = dicts, 0
        texts = [_node_text(r, session, nid) for nid in matched]
        if history == History.TEMPLATE and matched:
            # follow the template: keep matched messages only while it renders them as stored
            prompt = template.render(dicts, tools, add_generation_prompt=True)
            at = 0
            for i, t in enumerate(texts):
                if not prompt.startswith(t, at):
                    matched, texts = matched[:i], texts[:i]
                    break
                at += len(t)
        j = len(matched)
        cut = _resume_offset(template, dicts, j, tools, "".join(texts)) if j else 0
        if j and cut == 0:
            cut = template.stable_end(dicts[:j], tools)
    j = len(matched)
    known = min(known, j)
    segments = (walked.segments[:known] if known else []) + [
        Segment(keys[i], tree.nodes[nid].tokens, tree.nodes[nid].message_role) for i, nid in enumerate(matched[known:], known)]
    nodes: list[int | None] = list(matched)
    new_texts, gen = template.segments(view, tools, start=j - base, cut=cut)
    reused = j
    for i, text in zip(range(j, len(messages)), new_texts):
        msg = messages[i]
        out_ids = session.generated.get(keys[i]) if msg.role == "assistant" else None
        if out_ids is not None and history == History.EXACT:
            v = i - base
            toks = _sampled_segment(r, text, template.segments(view[:v], tools, start=v)[1] if v else "", out_ids)
            reused += 1
        else:
            toks = encode_segment(r, text, [msg.reasoning, msg.content])
        segments.append(Segment(keys[i], toks, msg.role))
        nodes.append(None)
    prompt_ids = encode_segment(r, gen, [])
    n_known = walked.ends[known - 1] if known else 0
    n_input = n_known + sum(len(s.tokens) for s in segments[known:]) + len(prompt_ids)
    return PreparedCall(segments, prompt_ids, n_input, reused, nodes, walked, known, dicts)
