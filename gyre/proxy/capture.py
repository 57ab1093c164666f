"""Per-execution capture: turn an OpenAI request into exact input ids, record the call.

Token truth (ARCHITECTURE.md invariant 1): the request's messages are walked down the
execution's tree; matched messages reuse the stored ids, assistant messages that the proxy itself
returned reuse the sampled ids wherever they reappear (after a compaction, in a sub-agent), and
only genuinely new messages are rendered and tokenized.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import dataclass, field

import numpy as np

from gyre.proxy.body_cache import BodyCache
from gyre.proxy.chat import Control, Message, render_body
from gyre.traj.record import ExecutionRecord
from gyre.traj.tree import ROOT, CallRecord, Segment, TrajectoryTree


GIL_FREE_CHARS = 4096  # longer texts are encoded with the GIL released (gyre.proxy.offload)


def _encode(tok, text: str) -> list[int]:
    # encode_batch releases the GIL, encode does not: a long text is tokenized while the loop runs on
    if len(text) > GIL_FREE_CHARS:
        return tok.encode_batch([text], add_special_tokens=False)[0].ids
    return tok.encode(text, add_special_tokens=False).ids


class Renderer:
    """ChatML segments over a `tokenizers.Tokenizer` (the model's own tokenizer.json).

    Two encoders: ``encode`` for the template's own text (control tokens honoured) and
    ``encode_text`` for message text, where special tokens are plain characters, so only the
    template produces control ids (a tool output cannot forge a turn).

    End-of-turn ids: `end_ids` (from the model directory: `gyre.model.chat_template.end_token_ids`),
    else ChatML's ``<|im_end|>`` and ``<|endoftext|>``. The built-in ChatML renderer needs
    ``<|im_end|>`` (`require_chatml`); a model's own template (Llama 3) need not have it."""

    def __init__(self, tokenizer, end_ids: list[int] | None = None):
        self.tok = tokenizer
        from tokenizers import Tokenizer

        self._plain = Tokenizer.from_str(tokenizer.to_str())
        self._plain.encode_special_tokens = True
        self.im_end = tokenizer.token_to_id("<|im_end|>")
        self.eos = tokenizer.token_to_id("<|endoftext|>")
        self.end_ids = list(end_ids or (i for i in (self.im_end, self.eos) if i is not None))
        if not self.end_ids:
            raise ValueError("no end-of-turn token: the tokenizer has no <|im_end|> and the model directory names "
                             "none (add eos_token_id to generation_config.json)")
        if self.im_end is not None:
            self.newline = self.encode("\n")
            self.assistant_head = self.encode("<|im_start|>assistant\n")

    def require_chatml(self) -> None:
        """The built-in renderer writes ChatML: refuse a tokenizer without its tokens, at start."""
        for text in ("<|im_start|>", "<|im_end|>"):
            if self.tok.token_to_id(text) is None:
                raise ValueError(f"tokenizer has no {text} token: the built-in renderer writes ChatML (Qwen format); "
                                 "serve this model with its own template (proxy.chat_template = \"model\")")

    def _special(self, text: str) -> int:
        tid = self.tok.token_to_id(text)
        if tid is None:
            raise ValueError(f"tokenizer has no {text} token; Gyre's built-in renderer writes ChatML (Qwen format)")
        return tid

    def encode(self, text: str) -> list[int]:
        return _encode(self.tok, text)

    def encode_text(self, text: str) -> list[int]:
        return _encode(self._plain, text)

    def encode_parts(self, parts: list) -> list[int]:
        """Text pieces as plain text, :class:`~gyre.proxy.chat.Control` pieces as their one id."""
        out: list[int] = []
        for p in parts:
            if isinstance(p, Control):
                out.append(self._special(p.text))
            elif p:
                out.extend(self.encode_text(p))
        return out

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def decode_output(self, ids: list[int]) -> str:
        """An output's text without the end-of-turn token that ended it (not content)."""
        return self.decode(ids[:-1] if ids and ids[-1] in self.end_ids else ids)

    def stop_ids(self) -> list[int]:
        return list(self.end_ids)


@dataclass
class Walked:
    """One recorded call's request as the next call's walk down the tree finds it.

    An agent re-sends its whole history on every call; a call whose messages start with these
    (compared as parsed JSON, in C) takes their parse, keys, segments and tree nodes from here
    and walks only the rest, so the proxy's work per call follows the call's new messages, not
    the execution so far (ARCHITECTURE.md invariant 10). ``segments``/``nodes``/``ends``/``opens``
    cover the leading messages the walk matched to tree nodes; ``messages``/``keys`` all of them.
    """

    raw: list                     # the request's messages, as parsed JSON
    salt: str                     # tools_salt of the request (it keys the first message)
    offset: int                   # messages the proxy put before raw (a default system message)
    messages: list[Message]
    keys: list[str]
    segments: list[Segment]
    nodes: list[int]
    ends: list[int]               # input tokens up to and including each matched message
    opens: list[tuple[bool, bool]]  # built-in renderer state after each one: (turn open, tool turn)
    tree_len: int                 # tree size when the walk was made
    dicts: list[dict] | None = None  # template path: messages as chat templates read them

    def common(self, raw: list, salt: str) -> int:
        """How many leading raw messages equal this walk's (0 if the tools differ)."""
        if salt != self.salt or not raw or not self.raw:
            return 0
        n = min(len(raw), len(self.raw))
        if raw[:n] == self.raw[:n]:  # the usual case: the history grew at its end
            return n
        lo, hi = 0, n - 1  # binary search on prefix equality: C comparisons, not a Python loop
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if raw[:mid] == self.raw[:mid]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def valid(self, known: int, session: "ExecutionSession") -> int:
        """``known`` cut to the messages whose node a fresh walk would still find: a node added
        since under the same parent and key (another call of this execution) takes over."""
        tree = session.tree
        for n in tree.nodes[self.tree_len:]:
            depth = session.walk_depth.get((n.parent, n.key))
            if depth is not None and depth < known:
                known = depth
        return known


@dataclass
class PreparedCall:
    segments: list[Segment]
    prompt_tokens: list[int]
    n_input: int  # len(input_ids)
    n_reused: int  # messages whose ids came from the tree or from earlier outputs
    nodes: list[int | None] = field(default_factory=list)  # the tree node of each reused segment
    walked: Walked | None = None  # the earlier walk this call started from
    known: int = 0  # leading segments taken from `walked` (a path of the tree)
    dicts: list[dict] | None = None  # template path: the messages as the template read them

    @property
    def input_ids(self) -> list[int]:
        """The ids the engine gets (built on demand: 32K+ of them are rarely needed as a list)."""
        return np.concatenate([np.asarray(s.tokens, dtype=np.int64) for s in self.segments]
                              + [np.asarray(self.prompt_tokens, dtype=np.int64)]).tolist()


class WireIds:
    """Input ids with their JSON text already made: the engine client sends ``json_text``
    instead of encoding 30K+ integers again (2 ms per call at 32K tokens). Behaves as a
    read-only sequence; the ids themselves are only built if someone iterates them (a router
    continuing a broken stream)."""

    def __init__(self, json_text: str, length: int, build):
        self.json_text, self._len, self._build, self._ids = json_text, length, build, None

    def _list(self) -> list[int]:
        if self._ids is None:
            self._ids = self._build()
        return self._ids

    def __len__(self) -> int:
        return self._len

    def __iter__(self):
        return iter(self._list())

    def __getitem__(self, i):
        return self._list()[i]

    def __eq__(self, other) -> bool:
        return list(self) == list(other)

    def __add__(self, other) -> list[int]:
        return self._list() + list(other)


def wire_ids(session: "ExecutionSession", prepared: PreparedCall, tail: list[int]) -> WireIds:
    """``prepared.input_ids + tail`` with its JSON digits built from per-node pieces encoded once
    per execution (a long execution re-sends the same stored ids on every call). The digits of
    the tree path the last call was sent with are kept joined: a call on that path joins only
    its segments after it, not one piece per message of the history."""
    nodes = prepared.nodes
    path = len(nodes)  # the leading segments that are tree nodes (a path from the root; new ones follow)
    while path and nodes[path - 1] is None:
        path -= 1
    kept = session.wire_path
    start, parts = 0, []
    if kept is not None and 0 < kept[1] <= path and nodes[kept[1] - 1] == kept[0]:
        # a node stands for its whole path from the root: the first kept[1] segments are those nodes
        start = kept[1]
        if kept[2]:
            parts.append(kept[2])
    for k in range(start, len(nodes)):
        seg, nid = prepared.segments[k], nodes[k]
        piece = session.wire.get(nid) if nid is not None else None
        if piece is None:
            piece = json.dumps(np.asarray(seg.tokens).tolist())[1:-1]
            if nid is not None:
                session.wire[nid] = piece
        if piece:
            parts.append(piece)
        if k + 1 == path and path > start:  # the path's digits, joined once for the calls that follow it
            session.wire_path = (nid, path, ", ".join(parts))
    tail = list(tail)
    rest = list(prepared.prompt_tokens) + tail
    if rest:
        parts.append(json.dumps(rest)[1:-1])
    return WireIds(", ".join(parts), prepared.n_input + len(tail), lambda: prepared.input_ids + tail)


@dataclass
class ExecutionSession:
    record: ExecutionRecord
    api_key: str
    # assistant message key -> output ids the proxy returned for it (most recent sample)
    generated: dict[str, list[int]] = field(default_factory=dict)
    ended: bool = False
    in_flight: int = 0
    wire: dict[int, str] = field(default_factory=dict)  # node id -> JSON digits of its tokens
    wire_path: tuple[int, int, str] | None = None  # (last node, segments, their joined digits): see wire_ids
    replay: object | None = None  # gyre.proxy.replay.Replay of a resumed execution's recorded calls
    walked: Walked | None = None  # the last recorded call's walk (see Walked)
    # (parent, key) -> depth of every node a walk kept: a new node with the same pair replaces it
    walk_depth: dict[tuple[int, str], int] = field(default_factory=dict)
    texts: dict[int, str] = field(default_factory=dict)  # node id -> decoded text (template path)
    body: BodyCache = field(default_factory=BodyCache)  # the last chat body, parsed (gyre.proxy.body_cache)
    renders_whole: bool = False  # its last call's template window did not hold (template path)
    salted: tuple[list, str] | None = None  # the last tools list salted and its salt (see salt_of)
    sampling: object | None = None  # gyre.proxy.params.SamplingPolicy of this execution (None: the proxy's)
    tokens_out: int = 0  # sampled tokens of its recorded calls (proxy.execution_token_budget)
    budget_spent: bool = False  # its token budget is used up: further calls are refused
    on_budget_spent: object | None = None  # called (no arguments) at its first refused call: ends the harness
    sampling_changed: int = 0  # calls whose temperature/top_p the sampling policy changed

    @property
    def tree(self) -> TrajectoryTree:
        return self.record.tree

    def salt_of(self, tools: list[dict]) -> str:
        """tools_salt of a call's tools: a harness sends the same tools on every call, and comparing
        the lists is cheaper than serializing and hashing them again (once to decide where a call
        is prepared, once to prepare it)."""
        if self.salted is None or self.salted[0] != tools:
            self.salted = (tools, tools_salt(tools))
        return self.salted[1]


def tools_salt(tools: list[dict]) -> str:
    if not tools:
        return ""
    return hashlib.blake2b(json.dumps(tools, sort_keys=True, ensure_ascii=False).encode(), digest_size=16).hexdigest()


def message_keys(messages: list[Message], salt: str, known: list[str] = ()) -> list[str]:
    """Each message's tree key (the first one salted with the tools); ``known``: keys of the
    leading messages, already computed."""
    keys = list(known[:len(messages)])
    keys += [m.key(salt if i == 0 else "") for i, m in enumerate(messages[len(keys):], len(keys))]
    return keys


def walk_start(session: ExecutionSession, same: int) -> tuple[Walked | None, int]:
    """The earlier walk a call can start from and how many leading messages it covers, given
    that the call's first ``same`` messages are the walk's own (`Walked.common`)."""
    w = session.walked
    known = w.valid(min(same, len(w.nodes)), session) if w is not None and same else 0
    return (w, known) if known else (None, 0)


def prepare_call(r: Renderer, session: ExecutionSession, messages: list[Message], tools: list[dict],
                 keys: list[str] | None = None, same: int = 0) -> PreparedCall:
    """Input ids of a call; ``same``: its leading messages that are those of ``session.walked``
    (their walk is taken from there)."""
    tree = session.tree
    keys = keys if keys is not None else message_keys(messages, tools_salt(tools))
    walked, known = walk_start(session, same)
    segments: list[Segment] = walked.segments[:known] if known else []
    nodes: list[int | None] = walked.nodes[:known] if known else []
    parent, matching, is_open, prev_tool, reused = ROOT, True, False, False, 0
    n_known = 0
    if known:
        parent, reused, n_known = walked.nodes[known - 1], known, walked.ends[known - 1]
        is_open, prev_tool = walked.opens[known - 1]
    for i in range(known, len(messages)):
        msg, key = messages[i], keys[i]
        if matching:
            nid = tree.find_child(parent, key)
            if nid is not None:
                node = tree.nodes[nid]
                segments.append(Segment(key, node.tokens, node.message_role))
                nodes.append(nid)
                parent, reused = nid, reused + 1
                is_open = msg.role == "tool" or (node.is_target and int(node.tokens[-1]) != r.im_end)
                prev_tool = msg.role == "tool"
                continue
            matching = False
        continues_tool_turn = msg.role == "tool" and prev_tool
        prefix = ([r.im_end] if is_open and not continues_tool_turn else []) + (r.newline if i > 0 else [])
        out_ids = session.generated.get(key) if msg.role == "assistant" else None
        if out_ids is not None:  # a message this proxy sampled: its exact ids, never a re-encoding
            toks = prefix + r.assistant_head + out_ids
            is_open, reused = (out_ids[-1] != r.im_end) if out_ids else True, reused + 1
        else:
            toks = prefix + r.encode_parts(render_body(msg, tools, i == 0, prev_tool))
            is_open = msg.role == "tool"
        segments.append(Segment(key, toks, msg.role))
        nodes.append(None)
        prev_tool = msg.role == "tool"
    prompt = ([r.im_end] if is_open else []) + r.newline + r.assistant_head
    n_input = n_known + sum(len(s.tokens) for s in segments[known:]) + len(prompt)
    return PreparedCall(segments, prompt, n_input, reused, nodes, walked, known)


def remember(session: ExecutionSession, prepared: PreparedCall, raw: list, salt: str, offset: int,
             messages: list[Message], keys: list[str], im_end: int, dicts: list[dict] | None = None) -> None:
    """After a call is recorded: keep its request's walk for the next call (see `Walked`). Costs
    the messages the call's own walk did not take from an earlier one."""
    tree, w = session.tree, prepared.walked
    known = w.valid(prepared.known, session) if w is not None else 0
    segments = w.segments[:known] if known else []
    nodes = w.nodes[:known] if known else []
    ends = w.ends[:known] if known else []
    opens = w.opens[:known] if known else []
    parent = nodes[-1] if known else ROOT
    for i in range(known, len(messages)):
        nid = tree.find_child(parent, keys[i])
        if nid is None:
            break
        node, role = tree.nodes[nid], messages[i].role
        segments.append(Segment(keys[i], node.tokens, node.message_role))
        nodes.append(nid)
        ends.append((ends[-1] if ends else 0) + len(node.tokens))
        opens.append((role == "tool" or (node.is_target and int(node.tokens[-1]) != im_end), role == "tool"))
        session.walk_depth[(parent, keys[i])] = i
        parent = nid
    session.walked = Walked(raw, salt, offset, messages, keys, segments, nodes, ends, opens, len(tree.nodes), dicts)


def record_call(session: ExecutionSession, prepared: PreparedCall, reply: Message, output_ids: list[int],
                logprobs: list[float], *, agent_role: str, weight_version: str, endpoint: str,
                finish_reason: str, t_start: float, replay_ids: list[int] | None = None,
                sampling: dict | None = None) -> CallRecord:
    """Record the call; ``replay_ids`` (default: the output) are the assistant ids that a replay
    of this reply reuses (forced tool-call ids + output, when tool_choice forced a call);
    ``sampling``: the engine's sampling parameters, stored with the call."""
    key = reply.key()
    known = prepared.walked.valid(prepared.known, session) if prepared.walked is not None else 0
    path = (known, prepared.walked.nodes[known - 1], prepared.walked.ends[known - 1]) if known else None
    rec = session.tree.add_call(
        prepared.segments, key, prepared.prompt_tokens, output_ids, logprobs, agent_role=agent_role,
        weight_version=weight_version, policy_version=policy_version_of(weight_version),
        endpoint=endpoint, finish_reason=finish_reason, t_start=t_start, t_end=time.time(), sampling=sampling,
        path=path)
    session.generated[key] = list(output_ids if replay_ids is None else replay_ids)
    if reply.reasoning:  # a harness that drops reasoning_content when it replays the turn: same ids
        session.generated[Message(reply.role, reply.content, reply.tool_calls).key()] = session.generated[key]
    return rec


def policy_version_of(weight_version: str) -> int:
    try:
        return int(weight_version)
    except (TypeError, ValueError):
        return -1


def new_api_key() -> str:
    return "gyre-" + secrets.token_urlsafe(24)
