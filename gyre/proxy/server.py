"""The token-in/token-out proxy: an OpenAI-compatible endpoint in front of the engine router.

Harnesses speak OpenAI chat; the proxy renders with exact token reuse, calls the engine with
``input_ids`` (never text), records every call into the execution's trajectory tree, and
answers in OpenAI's format (JSON or SSE). Each execution has its own API key; the key decides
which tree a call lands in. Head-side code registers and ends executions through the `Proxy`
object or the admin routes (guarded by the job's admin key).

What a harness can rely on (errors, parameters, streaming, cancellation, token safety) is
docs/openai.md. In short: client mistakes are OpenAI-shaped 4xx (a too-long prompt is 400
``context_length_exceeded``, checked before the engine is called), engine faults 503; streamed
tokens are passed on as the engine produces them; a call whose client went away, or whose
generation the engines kept aborting, is never recorded (it never trains) and is counted in
``/gyre/stats`` under ``abandoned``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hmac
import json
import logging
import re
import time
import uuid
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError
from aiohttp.web_protocol import RequestPayloadError

from gyre.config import History, ReasoningParser, TemplateSource
from gyre.engine.client import EngineError
from gyre.engine.router import RouterError
from gyre.model.chat_template import ChatTemplate, end_token_ids
from gyre.model.parsers import parse
from gyre.model.tokenizer import load_tokenizer
from gyre.proxy.body import over_bound, parse_chat_body, prompt_chars, refusal
from gyre.proxy.json_body import parse_json
from gyre.proxy.capture import (ExecutionSession, PreparedCall, Renderer, message_keys, new_api_key,
                                prepare_call, record_call, remember, wire_ids)
from gyre.proxy.chat import (DEFAULT_TOOL_SYSTEM, Message, MessageError, ParsedOutput, ToolCall, canonical_arguments,
                             parse_messages, parse_output, strip_end_tokens, validate_tools)
from gyre.proxy.fairness import CallGate
from gyre.proxy.journal import Journal
from gyre.proxy.offload import BIG_BODY_BYTES, INLINE_CHARS, PrepareWorkers, max_token_chars, text_chars
from gyre.proxy.params import MAX_DEPTH, CallParams, RequestError, check_depth, forced_prefix, parse_params
from gyre.proxy.sampling import SamplingPolicy, budget_left, count_call
from gyre.proxy.replay import Replay
from gyre.proxy.streaming import ContentStream, ReasoningStream
from gyre.proxy.template_capture import check_template, prepare_call_template
from gyre.proxy.token_safety import check_names, template_tokens
from gyre.traj.record import FINISHED, ExecutionRecord
from gyre.traj.routing import record_call_routing
from gyre.traj.tree import TrajectoryTree

log = logging.getLogger("gyre.proxy")

ROLE_HEADER = "X-Gyre-Role"
_ROLE_MODELS = ("main", "compactor")


def agent_role_of(model: Any, header: str | None) -> str:
    """Agent role from the X-Gyre-Role header, else from the model name, else `main`. The role
    is written into shards: one that is not printable Unicode (aiohttp hands a non-UTF-8 header
    over surrogate-escaped) is refused here, never met by the shard writer."""
    if header:
        return _checked_role(header.strip()[:128], f"header {ROLE_HEADER}")
    if isinstance(model, str) and (model in _ROLE_MODELS or model.startswith("subagent:")):
        return _checked_role(model[:128], "model")
    return "main"


def _checked_role(role: str, where: str) -> str:
    if not role.isprintable():  # surrogates and control characters are not printable
        raise RequestError(400, f"{where}: the agent role {ascii(role)[:80]} holds a character that is not "
                                "printable text (a control character or an undecodable byte); send a "
                                "printable UTF-8 name such as 'main' or 'subagent:search'",
                           param="model" if where == "model" else None)
    return role


def _error(status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
           param: str | None = None) -> web.Response:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return web.json_response({"error": {"message": message, "type": type, "param": param, "code": code}},
                             status=status)


_CONTEXT_RE = re.compile(r"\((\d+) tokens\) is longer than the model's context length \((\d+) tokens\)")


def context_error(tokens: int, limit: int, at_least: bool = False) -> RequestError:
    """OpenAI's own wording and code, which the openai SDK and litellm map to their
    context-window exceptions (so a harness can compact and go on)."""
    return RequestError(400, f"This model's maximum context length is {limit} tokens. However, your messages "
                             f"resulted in {'at least ' if at_least else ''}{tokens} tokens. Please reduce the "
                             "length of the messages.",
                        code="context_length_exceeded", param="messages")


def engine_failure(e: Exception) -> RequestError:
    """An engine-side failure as the harness should see it: its own request's fault -> 4xx,
    the backend's -> 5xx (retryable)."""
    if isinstance(e, EngineError) and e.status is not None and 400 <= e.status < 500 and e.status != 429:
        m = _CONTEXT_RE.search(e.message)
        if m:
            return context_error(int(m.group(1)), int(m.group(2)) - 1)
        return RequestError(400, f"the model engine refused the request: {e.message}")
    return RequestError(503, f"model backend unavailable, retry later: {e}", "server_error", "backend_unavailable")


class TooManyExecutions(ValueError):
    """The proxy holds `max_executions` registered executions already."""


class AbortedCall(Exception):
    """The engine aborted the generation and the router could not finish it elsewhere."""


@dataclass
class Call:
    """One chat completion between parsing and recording."""
    sess: ExecutionSession
    body: dict
    role: str
    params: CallParams
    tools: list[dict]
    prepared: PreparedCall
    forced: list[int]  # assistant ids placed before sampling (tool_choice), recorded as prompt
    engine_params: dict
    rid: str
    t0: float
    engine_s: float = 0.0  # time on the wire to the engine and back (not the proxy's own work)
    priority: int | None = None  # the engines admit higher first (gyre.proxy.fairness)
    wire: Any = None  # the input ids as sent (their key journals the call, gyre.proxy.journal)
    # the request's messages for the next call's walk (capture.remember): raw, tools salt, offset,
    # parsed messages, their keys
    walk: tuple = ()

    @property
    def id(self) -> str:
        return f"chatcmpl-{self.rid}"


def template_options(proxy_cfg, model_dir) -> dict:
    """Proxy keyword arguments for the model directory's chat template from `[proxy]` (the
    template is loaded, and refused with a clear error, here)."""
    if proxy_cfg.chat_template != TemplateSource.MODEL:
        return {}

    template = ChatTemplate.from_dir(model_dir)
    if template is None:
        raise ValueError(f"proxy.chat_template = \"model\" but {model_dir} has no chat template (chat_template.jinja "
                         f"or tokenizer_config.json's chat_template); add one or use proxy.chat_template = \"builtin\"")
    tokenizer = load_tokenizer(model_dir)
    return {"chat_template": template, "history": proxy_cfg.history, "tool_parser": proxy_cfg.tool_parser,
            "reasoning_parser": proxy_cfg.reasoning_parser, "end_ids": end_token_ids(model_dir, tokenizer.token_to_id)}


def context_length(model_dir: Path) -> int | None:
    """max_position_embeddings from config.json; None (ask the engines) when there is none."""
    try:
        v = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8")).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return v if isinstance(v, int) and v > 1 else None


def routing_options(train_cfg, model_dir) -> dict:
    """Proxy keyword arguments for ``train.routing_replay``: the served model's (MoE layers,
    top_k, experts), refused with a clear error for a dense model."""
    if not train_cfg.routing_replay:
        return {}
    from gyre.model.spec import read_spec

    spec = read_spec(model_dir)
    if not spec.moe_layers:
        raise ValueError(f"train.routing_replay = true but {model_dir} is a dense model (no routed experts); "
                         "set train.routing_replay = false")
    return {"routing": (len(spec.moe_layers), spec.top_k, spec.experts)}


class Proxy:
    """Sessions, rendering and capture; `create_app` exposes it over HTTP."""

    @classmethod
    def from_config(cls, cfg, router, model_dir, identity: dict) -> "Proxy":
        """The proxy every driver serves (`gyre rollout`, the head, `gyre proxy`) from a GyreConfig:
        the model directory's tokenizer, context length and (proxy.chat_template = model) template,
        `[proxy]`'s limits and (train.routing_replay) the experts to record."""
        proxy_cfg = cfg.proxy
        return cls(router, load_tokenizer(model_dir), identity=identity,
                   default_max_tokens=proxy_cfg.default_max_tokens, max_tokens_cap=proxy_cfg.max_tokens_cap,
                   max_executions=proxy_cfg.max_executions, max_calls_in_flight=proxy_cfg.max_calls_in_flight,
                   context_length=context_length(model_dir), **template_options(proxy_cfg, model_dir),
                   **routing_options(cfg.train, model_dir), sampling=SamplingPolicy.from_config(proxy_cfg),
                   token_budget=proxy_cfg.execution_token_budget)

    def __init__(self, router, tokenizer, *, model_name: str = "gyre", default_max_tokens: int = 512,
                 max_tokens_cap: int = 4096, identity: dict | None = None, context_length: int | None = None,
                 max_executions: int = 10_000, max_calls_in_flight: int = 8, chat_template=None, history: str = "exact",
                 tool_parser: str = "hermes", reasoning_parser: str = "none", end_ids: list[int] | None = None,
                 routing: tuple[int, int, int] | None = None, sampling: SamplingPolicy | None = None,
                 token_budget: int = 0):
        self.router = router
        # proxy.sampling: temperature/top_p of training executions (gyre.proxy.params.SamplingPolicy)
        self.sampling = sampling or SamplingPolicy()
        self.sampling_changed = 0  # calls whose sampling the policy changed
        self.token_budget = token_budget  # sampled tokens per execution; 0 = none
        # routing replay: (MoE layers, top_k, experts) of the served model; the engine is asked for
        # the routed experts of every call and they are stored per node (gyre.traj.routing)
        self.routing = routing
        self.routing_missing = 0  # calls answered without routed experts although asked
        self.renderer = Renderer(tokenizer, end_ids)
        self.workers = PrepareWorkers()
        # a chat body of more bytes is parsed in a worker process, by this function (gyre.proxy.body)
        self.big_body_bytes, self.parse_big_body = BIG_BODY_BYTES, parse_chat_body
        self.max_token_chars = max_token_chars(tokenizer)
        self.template_tokens = template_tokens(tokenizer)
        # the model's own chat template (gyre.model.chat_template.ChatTemplate); None = built-in ChatML
        self.template, self.history = chat_template, history
        self.tool_parser, self.reasoning_parser = tool_parser, reasoning_parser
        self.template_conformance: dict | None = None
        self.template_window = False  # render only the new end of the conversation (append-only templates)
        if chat_template is None:
            self.renderer.require_chatml()
        else:  # refused here, with the reason, when its segments' ids are not the whole prompt's
            self.template_conformance = check_template(self.renderer, chat_template)
            self.template_window = all(self.template_conformance[k] for k in ("append_only", "incremental_exact"))
            if not self.template_conformance["append_only"]:
                log.warning("the model's chat template is not append-only (%s); proxy.history=%s: %s",
                            self.template_conformance["breaks"][0]["why"], history,
                            "sampled turns are kept as sampled" if history == History.EXACT
                            else "the tree branches where the template rewrites history")
        self.model_name = model_name
        self.default_max_tokens, self.max_tokens_cap = default_max_tokens, max_tokens_cap
        self.identity = identity or {}
        # the longest prompt the engine accepts (SGLang's max_req_input_len); asked once if not given
        self.max_input_tokens: int | None = None if context_length is None else context_length - 1
        self.max_executions = max_executions
        self.gate = CallGate(max_calls_in_flight)  # per-execution cap and engine priority (gyre.proxy.fairness)
        self.journal: Journal | None = None  # each recorded call, before its answer (gyre.proxy.journal)
        self.sessions: dict[str, ExecutionSession] = {}  # api key -> session
        # rid -> (execution id, its loop) of every running call: ending an execution aborts them
        self._live: dict[str, tuple[str, asyncio.AbstractEventLoop]] = {}
        self.by_id: dict[str, ExecutionSession] = {}
        self.calls_total = 0
        # calls that never reached their client whole: not in any tree (never trained), counted here
        self.abandoned: collections.Counter[str] = collections.Counter()
        # seconds each call spent in the proxy itself (handler time minus the engine round trip)
        self.overhead_s: collections.deque[float] = collections.deque(maxlen=100_000)

    # -- execution registry (head side) ---------------------------------------------------
    def register(self, execution_id: str, task: str = "", group: int = 0, api_key: str | None = None,
                 replay: TrajectoryTree | Replay | None = None, sampling: SamplingPolicy | None = None) -> str:
        """A key for a new execution; ``replay``: the tree a stopped run of it recorded (or the
        Replay of a killed run's journal), whose calls are answered again where the resumed
        harness asks the same (gyre.proxy.replay). ``sampling``: its own sampling policy (e.g. a
        validation execution's); None: the proxy's."""
        if execution_id in self.by_id:
            raise ValueError(f"execution {execution_id!r} is already registered")
        if len(self.by_id) >= self.max_executions:
            raise TooManyExecutions(f"{len(self.by_id)} executions are registered, the limit "
                                    f"(proxy.max_executions) is {self.max_executions}; end some first")
        key = api_key or new_api_key()
        sess = ExecutionSession(ExecutionRecord(execution_id, task, group, t_start=time.time()), key,
                                replay=replay if isinstance(replay, Replay) and replay.recorded else
                                Replay(replay) if isinstance(replay, TrajectoryTree) and replay.calls else None)
        sess.sampling = sampling
        self.sessions[key] = sess
        self.by_id[execution_id] = sess
        return key

    def budget_spent(self, execution_id: str) -> bool:
        """The execution used up proxy.execution_token_budget (it ends as a timeout)."""
        sess = self.by_id.get(execution_id)
        return sess is not None and sess.budget_spent

    def calls_made(self, execution_id: str) -> int:
        """Calls recorded so far for a registered execution."""
        return len(self.by_id[execution_id].tree.calls)

    def end(self, execution_id: str, status: str = "done") -> ExecutionRecord:
        """Revoke the execution's key and hand back its record (tree included)."""
        sess = self.by_id.pop(execution_id)
        self.sessions.pop(sess.api_key, None)
        sess.ended = True
        sess.record.status, sess.record.t_end = status, time.time()
        for rid, (eid, loop) in list(self._live.items()):  # its running calls end now, not at their end
            if eid == execution_id and not loop.is_closed():
                loop.call_soon_threadsafe(lambda r=rid, lp=loop: lp.create_task(self.router.abort(r)))
        return sess.record

    @contextlib.contextmanager
    def _track(self, c: "Call"):
        """The call is live (aborted by `end` of its execution) while inside."""
        self._live[c.rid] = (c.sess.record.execution_id, asyncio.get_running_loop())
        try:
            yield
        finally:
            self._live.pop(c.rid, None)

    def session_for(self, auth: str | None) -> ExecutionSession:
        if not auth or not auth.startswith("Bearer "):
            raise RequestError(401, "missing API key: send 'Authorization: Bearer <execution key>'",
                               "authentication_error", "invalid_api_key")
        key = auth[7:].strip()
        sess = self.sessions.get(key)
        if sess is None:
            raise RequestError(401, "unknown or revoked API key", "authentication_error", "invalid_api_key")
        return sess

    # -- one call -------------------------------------------------------------------------
    async def _input_limit(self) -> int | None:
        if self.max_input_tokens is None:
            info = getattr(self.router, "server_info", None)
            if info is not None:
                try:
                    data = await info()
                    limit = data.get("max_req_input_len") or (data.get("context_length") or 0) - 1
                    self.max_input_tokens = int(limit) if limit and limit > 0 else None
                except Exception as e:  # the engine's own check (mapped to the same 400) still holds
                    log.warning("could not read the engines' context length: %s", e)
        return self.max_input_tokens

    async def read_chat(self, sess: ExecutionSession, raw: bytes) -> tuple[dict, int | None]:
        """A chat body and (parsed off the loop) its prompt characters. A body over
        ``big_body_bytes`` is parsed in a worker process, queued behind its execution's own calls
        (an execution has one big body there at a time, never holding a sibling's back); a small
        one on the loop, which costs less than the round trip. On the loop, only what the
        execution's previous body did not hold is parsed (gyre.proxy.body_cache): a big body that
        is the previous one plus at most ``big_body_bytes`` is parsed there too."""
        if len(raw) <= self.big_body_bytes:  # parsed from where the execution's last body stops matching
            return sess.body.parse(raw)
        if sess.body.follows(raw, self.big_body_bytes):  # big, but all new in it is a small body's worth
            parsed = sess.body.parse(raw, whole=False)
            if parsed is not None:
                return parsed
        limit = await self._input_limit()
        try:
            async with self.workers.session(sess.record.execution_id):
                answer = await self.workers.parse(self.parse_big_body, raw, limit, self.max_token_chars)
        except BrokenProcessPool as e:  # a worker died (e.g. killed): the pool is replaced
            raise RequestError(503, f"the proxy's body parser failed, retry: {e}", "server_error")
        error = refusal(answer)
        if error is not None:
            raise error
        if answer.kept is not None:  # the next body parses from where this one stops matching
            sess.body.adopt(raw, answer.body, answer.kept)
        return answer.body, answer.chars

    async def prepare(self, sess: ExecutionSession, body: dict, role: str, chars: int | None = None) -> Call:
        """Parse, render and tokenize a request (off the event loop, gyre.proxy.offload), after a
        cheap bound that refuses a prompt too long for the engine without tokenizing it.
        ``chars``: the prompt's characters, when read_chat counted them."""
        limit = await self._input_limit()
        if chars is None:
            chars = prompt_chars(body)
        if over_bound(chars, limit, self.max_token_chars):
            raise context_error(chars // self.max_token_chars, limit + 1, at_least=True)
        async with self.workers.session(sess.record.execution_id):
            if self._fresh_chars(sess, body, chars) <= INLINE_CHARS:  # costs less than the hand-off (never queues)
                return self._prepare(sess, body, role, limit)
            return await self.workers.run(self._prepare, sess, body, role, limit)

    def _fresh_chars(self, sess: ExecutionSession, body: dict, chars: int) -> int:
        """The characters a preparation may render and tokenize: where it renders only what the
        execution's last recorded call did not send (the built-in renderer, a template whose
        window held last time), those of the messages after the ones that call sent, and the
        tools; else all of them.
        Under the session's lock (the walk is the one _prepare starts from)."""
        w, raw = sess.walked, body.get("messages")
        whole = self.template is not None and (not self.template_window or sess.renders_whole)
        if w is None or not isinstance(raw, list) or whole:
            return chars
        tools = body.get("tools")
        same = w.common(raw, sess.salt_of(tools) if isinstance(tools, list) else "")
        return text_chars(raw[same:]) + text_chars(tools) if same else chars

    def _prepare(self, sess: ExecutionSession, body: dict, role: str, limit: int | None) -> Call:
        raw = body.get("messages")
        check_depth({k: v for k, v in body.items() if k != "messages"})
        tools = validate_tools(body.get("tools"))
        salt, w = sess.salt_of(tools), sess.walked
        # messages the execution's last recorded call sent too are checked and parsed already
        same = w.common(raw, salt) if w is not None and isinstance(raw, list) else 0
        check_depth(raw[same:] if same else raw, MAX_DEPTH - 1)
        check_names(body, self.template_tokens, same)
        offset = w.offset if same else 0
        messages = (w.messages[:same + offset] if same else []) + parse_messages(raw, same)
        p = (sess.sampling or self.sampling).apply(parse_params(body, tools, self.default_max_tokens,
                                                                self.max_tokens_cap))
        left = budget_left(sess, self.token_budget)
        if self.template is None and not same and tools and messages[0].role != "system":
            # as the Qwen template: tools go in a system turn
            messages, offset = [Message("system", DEFAULT_TOOL_SYSTEM), *messages], 1
        same += offset if same else 0
        keys = message_keys(messages, salt, w.keys[:same] if same else ())
        if self.template is not None:
            # the model's own template renders tools with or without a system turn, as it does
            prepared = prepare_call_template(self.renderer, self.template, sess, messages, tools, self.history,
                                             keys, same, self.template_window)
        else:
            prepared = prepare_call(self.renderer, sess, messages, tools, keys, same)
        # plain-text encoding: a name can hold no control token (refused above), and never becomes one
        forced = self.renderer.encode_text(forced_prefix(p)) if forced_prefix(p) else []
        n_prompt = prepared.n_input + len(forced)
        max_new = p.max_new_tokens
        if limit is not None:
            if n_prompt > limit:  # before calling the engine: the harness must compact
                raise context_error(n_prompt, limit + 1)
            max_new = min(max_new, limit + 1 - n_prompt)  # as SGLang clamps to the context
        if left is not None:
            max_new = min(max_new, left)  # the call that reaches the budget samples what is left
        stop = list(p.stop) + (["<tool_call>"] if p.tool_choice == "none" and tools else [])
        eparams: dict[str, Any] = {"max_new_tokens": max_new, "temperature": p.temperature, "top_p": p.top_p,
                                   "stop_token_ids": self.renderer.stop_ids()}
        if stop:
            eparams["stop"] = stop
        if p.seed is not None:
            eparams["sampling_seed"] = p.seed
        rid = f"{sess.record.execution_id}-{uuid.uuid4().hex[:12]}"
        return Call(sess, body, role, p, tools, prepared, forced, eparams, rid, time.time(),
                    walk=(raw, salt, offset, messages, keys))

    def _generate_args(self, c: Call) -> tuple:
        return (c.sess.record.execution_id, wire_ids(c.sess, c.prepared, c.forced), c.engine_params)

    def _engine(self, c: Call, args: tuple):
        """The router, or (a resumed execution) the recorded answer to these exact input ids."""
        replay = c.sess.replay
        hit = replay.match(args[1]) if replay is not None else None
        return self.router if hit is None else hit

    def finish(self, c: Call, res) -> tuple[dict, Any]:
        """Record a finished generation and build the OpenAI response (non-streamed shape)."""
        sess, p = c.sess, c.params
        if sess.ended:  # the execution ended while its call ran (its generation was aborted): not recorded
            self.abandoned["execution_ended"] += 1
            raise RequestError(409, "execution ended while the call was running", "invalid_request_error",
                               "execution_ended")
        if res.finish_reason == "abort":
            self.abandoned["aborted"] += 1
            raise AbortedCall(res.finish_message or "generation aborted")
        out_ids, lps = list(res.output_ids), list(res.logprobs)
        text = self.renderer.decode_output(c.forced + out_ids)
        matched_stop = res.finish_reason == "stop" and isinstance(res.meta_info.get("finish_reason", {}).get("matched"), str)
        hits = [text.find(s) for s in c.engine_params.get("stop", ()) if s in text]
        if hits:
            text = text[: min(hits)]
        tools_on = bool(c.tools) and p.tool_choice != "none"
        reasoning = None
        if self.template is not None:  # parsers by name (gyre.model.parsers)
            parsed, reasoning = self._parse_named(text, tools_on)
        else:
            parsed = parse_output(text, tools_enabled=tools_on)
        reply = Message("assistant", parsed.content or "", tuple(parsed.tool_calls), reasoning or "")
        prepared = c.prepared
        if c.forced:  # forced ids are context the model saw, not samples
            prepared = dataclasses.replace(prepared, prompt_tokens=prepared.prompt_tokens + c.forced,
                                           n_input=prepared.n_input + len(c.forced))
        call = record_call(sess, prepared, reply, out_ids, lps, agent_role=c.role,
                           weight_version=str(res.weight_version), endpoint=res.endpoint,
                           finish_reason=res.finish_reason, t_start=c.t0, replay_ids=c.forced + out_ids,
                           sampling=c.engine_params)
        self.sampling_changed += count_call(sess, p, len(out_ids), self.token_budget)
        remember(sess, prepared, *c.walk, self.renderer.im_end, prepared.dicts)
        if self.journal is not None and c.wire is not None:  # durable past a SIGKILL before the harness hears
            self.journal.append(sess.record.execution_id, c.wire, out_ids, lps, res.finish_reason,
                                str(res.weight_version))
        if self.routing is not None:
            self._record_routing(sess, call, res)
        self.calls_total += 1
        if parsed.tool_calls:
            finish = "tool_calls"
        elif res.finish_reason == "length" and not matched_stop and not hits:
            finish = "length"
        else:
            finish = "stop"
        msg: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if reasoning:
            msg["reasoning_content"] = reasoning
        if parsed.tool_calls:
            msg["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:16]}", "type": "function",
                                  "function": {"name": t.name, "arguments": t.arguments}} for t in parsed.tool_calls]
        n_in = prepared.n_input
        resp = {
            "id": c.id, "object": "chat.completion", "created": int(c.t0),
            "model": c.body.get("model") or self.model_name,
            "choices": [{"index": 0, "message": msg, "finish_reason": finish,
                         "logprobs": self._logprobs(out_ids, res) if p.logprobs else None}],
            "usage": {"prompt_tokens": n_in, "completion_tokens": len(out_ids), "total_tokens": n_in + len(out_ids)},
            "gyre": {"call_index": call.index, "weight_version": call.weight_version, "reused_messages": prepared.n_reused,
                     # what the engine sampled with (stored with the call) and, where the policy changed
                     # it, what the harness asked for
                     "sampling": {"temperature": p.temperature, "top_p": p.top_p,
                                  **({"requested": p.requested} if p.requested else {})}},
        }
        return resp, parsed

    def _record_routing(self, sess: ExecutionSession, call, res) -> None:
        """The call's routed experts into its tree; a call answered without them (an engine not
        started with --enable-return-routed-experts) trains with free routing, counted and warned."""
        b64 = res.meta_info.get("routed_experts")
        if b64:
            try:
                record_call_routing(sess.tree, call, b64, self.routing)
                return
            except ValueError as e:
                log.warning("call %d of %s: routed experts not stored: %s", call.index,
                            sess.record.execution_id, e)
        elif not self.routing_missing:
            log.warning("train.routing_replay: the engine answered without routed experts (SGLang needs "
                        "--enable-return-routed-experts); such calls train with free routing")
        self.routing_missing += 1

    def _parse_named(self, text: str, tools_on: bool):
        """The configured tool-call and reasoning parsers, as the built-in path's ParsedOutput."""

        out = parse(strip_end_tokens(text), self.tool_parser, self.reasoning_parser, tools_enabled=tools_on)
        calls = [ToolCall(t.name, canonical_arguments(t.arguments, "output")) for t in out.tool_calls]
        return ParsedOutput(out.content, calls), out.reasoning_content

    def _logprobs(self, out_ids: list[int], res) -> dict:
        """OpenAI's ``logprobs.content``: every sampled token but a final end token, with the
        log-prob of the distribution it was drawn from (the one training uses)."""
        stop = set(self.renderer.stop_ids())
        n = len(out_ids) - (1 if out_ids and out_ids[-1] in stop else 0)
        return {"content": self._logprob_entries(out_ids, res, 0, n), "refusal": None}

    def _logprob_entries(self, out_ids: list[int], res, start: int, stop: int) -> list[dict]:
        """The `logprobs.content` entries of tokens [start, stop): a streamed chunk carries those
        of its own tokens (as OpenAI and SGLang stream them), so each is built once."""
        def entry(tid: int, lp: float) -> dict:
            tok = self.renderer.decode([tid])
            return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8", "surrogatepass"))}

        content = []
        for k in range(start, stop):
            e = entry(out_ids[k], res.logprobs[k])
            tops = res.top_logprobs[k] if k < len(res.top_logprobs) else []
            e["top_logprobs"] = [entry(t, lp) for lp, t in tops]
            content.append(e)
        return content

    async def complete(self, c: Call) -> dict:
        """Run one call to the end (non-streamed); returns the OpenAI response."""
        try:
            args = self._generate_args(c)  # the input ids' JSON, built once per call
            c.wire = args[1]
            with self._track(c):
                res = await self._engine(c, args).generate(*args, rid=c.rid, top_logprobs_num=c.params.top_logprobs,
                                                           priority=c.priority,
                                                           return_routed_experts=self.routing is not None)
        except asyncio.CancelledError:  # the client went away: the router aborted the engine request
            self.abandoned["client_disconnected"] += 1
            raise
        except (EngineError, RouterError) as e:
            raise engine_failure(e) from None
        c.engine_s = res.wire_s
        async with self.workers.session(c.sess.record.execution_id):  # no preparation reads the tree meanwhile
            return self.finish(c, res)[0]

    async def stream(self, c: Call, out: web.StreamResponse) -> None:
        """Stream one call: content deltas as tokens come, tool calls and usage at the end."""
        p = c.params
        base = {"id": c.id, "object": "chat.completion.chunk", "created": int(c.t0),
                "model": c.body.get("model") or self.model_name}
        tools_on = bool(c.tools) and p.tool_choice != "none"
        content = ContentStream(c.engine_params.get("stop", []), tools_on)
        if c.forced:
            content.closed = True  # the whole output is a tool call
        reasoning = ReasoningStream(content) if self.template is not None and self.reasoning_parser != ReasoningParser.NONE \
            else None

        stop_ids = set(self.renderer.stop_ids())
        lp = {"sent": 0, "snap": None}  # logprobs: tokens already carried by a chunk, the newest snapshot

        async def send(delta: dict, finish: str | None = None, **extra) -> None:
            snap = lp["snap"]
            ids = snap.output_ids if snap is not None else []
            upto = len(ids) - (1 if ids and ids[-1] in stop_ids else 0)  # an end token has none (as unstreamed)
            if p.logprobs and finish is None and upto > lp["sent"]:
                # this chunk carries the log-probs of the tokens sampled since the last one
                extra["logprobs"] = {"content": self._logprob_entries(ids, snap, lp["sent"], upto), "refusal": None}
                lp["sent"] = upto
            chunk = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]}
            await out.write(b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n")

        await send({"role": "assistant", "content": ""})
        args = self._generate_args(c)
        c.wire = args[1]
        gen = self._engine(c, args).generate_stream(*args, rid=c.rid, top_logprobs_num=p.top_logprobs,
                                                    priority=c.priority,
                                                    return_routed_experts=self.routing is not None)
        try:
            with self._track(c):
                final = await self._relay(c, gen, content, send, reasoning, lp)
        except (asyncio.CancelledError, ConnectionError):
            self.abandoned["client_disconnected"] += 1
            raise
        except (EngineError, RouterError) as e:
            await self._stream_error(out, engine_failure(e))
            return
        finally:
            await gen.aclose()
        if final is None and c.sess.ended:
            await self._stream_error(out, RequestError(409, "execution ended while the call was running",
                                                       code="execution_ended"))
            return
        if final is None:
            await self._stream_error(out, RequestError(503, "model backend ended the stream early", "server_error"))
            return
        try:
            async with self.workers.session(c.sess.record.execution_id):
                resp, parsed = self.finish(c, final)
        except AbortedCall as e:
            await self._stream_error(out, RequestError(503, f"generation aborted, retry: {e}", "server_error",
                                                       "generation_aborted"))
            return
        except RequestError as e:  # e.g. the execution ended while its call ran (409)
            await self._stream_error(out, e)
            return
        choice = resp["choices"][0]
        lp["snap"] = final  # the deltas held back until the end carry their tokens' log-probs too
        if reasoning is not None:
            r_rest = reasoning.rest(choice["message"].get("reasoning_content"))
            if r_rest:
                await send({"reasoning_content": r_rest})
        rest = content.rest(parsed.content)
        if rest:
            await send({"content": rest})
        for i, tc in enumerate(choice["message"].get("tool_calls") or []):
            await send({"tool_calls": [{"index": i, **tc}]})
        rest_lp = choice["logprobs"] and {**choice["logprobs"], "content": choice["logprobs"]["content"][lp["sent"]:]}
        await send({}, choice["finish_reason"], logprobs=rest_lp)  # the tokens no chunk carried yet
        if p.include_usage:
            await out.write(b"data: " + json.dumps({**base, "choices": [], "usage": resp["usage"]}).encode() + b"\n\n")
        await out.write(b"data: [DONE]\n\n")

    async def _relay(self, c: Call, gen, content: ContentStream, send, reasoning=None, lp: dict | None = None):
        """Pass content (or reasoning) deltas on as snapshots come; returns the final snapshot
        (None if none came). `lp["snap"]`: the newest snapshot, whose log-probs `send` attaches."""
        final = None
        async for snap in gen:  # the router ends after the final snapshot
            if snap.finish_reason is not None:
                final = snap
                continue
            if lp is not None:
                lp["snap"] = snap
            text = self.renderer.decode_output(c.forced + snap.output_ids)
            if reasoning is not None:
                delta = {k: v for k, v in reasoning.deltas(text).items() if v}
                if delta:
                    await send(delta)
                continue
            delta = content.delta(text)
            if delta:
                await send({"content": delta})
        return final

    @staticmethod
    async def _stream_error(out: web.StreamResponse, e: RequestError) -> None:
        """After the headers went out, an error can only travel as an event (the openai SDK
        raises it as an APIError)."""
        body = {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}
        await out.write(b"data: " + json.dumps(body).encode() + b"\n\n")
        await out.write(b"data: [DONE]\n\n")  # the stream is over: a client must not wait for more

    def overhead_percentiles(self) -> dict:
        if not self.overhead_s:
            return {"calls": 0}
        ms = sorted(x * 1e3 for x in self.overhead_s)
        pick = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]
        return {"calls": len(ms), "p50_ms": pick(0.5), "p99_ms": pick(0.99), "mean_ms": sum(ms) / len(ms)}


async def _read_body(request: web.Request) -> bytes:
    """The request's body bytes, refused when too big or unreadable as its headers say."""
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise RequestError(413, f"request body larger than the limit of {request.client_max_size} bytes "
                                f"(raise proxy.max_body_bytes if this is intended)")
    except (ContentEncodingError, RequestPayloadError) as e:  # e.g. Content-Encoding: gzip on a plain body
        raise RequestError(400, f"request body could not be read as its headers say (Content-Encoding, "
                                f"Content-Length): {getattr(e, 'message', e)}")


async def _read_json(request: web.Request, depth: bool = True) -> dict:
    """The request's JSON object, parsed on the loop (gyre.proxy.json_body.parse_json): the admin
    routes' small bodies."""
    return parse_json(await _read_body(request), depth)


def create_app(proxy: Proxy, *, admin_key: str, max_body_bytes: int = 8 << 20,
               on_end: Callable[[ExecutionRecord], dict] | None = None) -> web.Application:
    """`on_end`: what POST /gyre/executions/{eid}/end does with the ended record (a standalone
    proxy writes it to a shard, off the event loop); None: the route only ends the execution."""
    @web.middleware
    async def errors(request: web.Request, handler):
        try:
            return await handler(request)
        except RequestError as e:
            resp = _error(e.status, e.message, e.type, e.code, e.param)
            resp.headers.update(getattr(e, "headers", {}))  # e.g. Retry-After on a 429
            return resp
        except MessageError as e:
            return _error(400, str(e), param="messages")
        except AbortedCall as e:
            return _error(503, f"generation aborted by the engine, retry: {e}", "server_error", "generation_aborted")
        except web.HTTPException as e:
            if e.status == 413:
                return _error(413, f"request body larger than the limit of {max_body_bytes} bytes")
            if e.status in (404, 405):
                return _error(e.status, f"no route {request.method} {request.path}; "
                                        "this proxy serves POST /v1/chat/completions and GET /v1/models",
                              code="not_found")
            raise
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception as e:  # a bug must cost one request, not the proxy
            log.exception("call failed")
            return _error(500, f"internal error in the proxy: {type(e).__name__}: {e}", "server_error")

    app = web.Application(client_max_size=max_body_bytes, middlewares=[errors])

    async def stop_parsers(app: web.Application) -> None:  # the body parser processes end with the server
        await asyncio.to_thread(proxy.workers.close_parsers)  # joining them blocks
    app.on_cleanup.append(stop_parsers)

    async def chat(request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        sess = proxy.session_for(request.headers.get("Authorization"))
        body, chars = await proxy.read_chat(sess, await _read_body(request))
        with proxy.gate.admit(sess.record.execution_id) as priority:  # 429 beyond proxy.max_calls_in_flight
            call = await proxy.prepare(sess, body, agent_role_of(body.get("model"), request.headers.get(ROLE_HEADER)),
                                       chars)
            call.priority = priority
            if not call.params.stream:
                resp = await proxy.complete(call)
                out = web.json_response(resp)
                proxy.overhead_s.append(time.perf_counter() - t0 - call.engine_s)
                return out
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await out.prepare(request)
            await proxy.stream(call, out)
            await out.write_eof()
            return out

    async def models(request: web.Request) -> web.Response:
        proxy.session_for(request.headers.get("Authorization"))
        names = [proxy.model_name, "main", "compactor"]
        return web.json_response({"object": "list", "data": [
            {"id": n, "object": "model", "created": 0, "owned_by": "gyre"} for n in names]})

    def require_admin(request: web.Request) -> None:
        auth = request.headers.get("Authorization", "")
        if not hmac.compare_digest(auth.encode(), f"Bearer {admin_key}".encode()):
            raise RequestError(401, "admin routes need the job's admin key", "authentication_error")

    async def register(request: web.Request) -> web.Response:
        require_admin(request)
        body = await _read_json(request)
        eid = body.get("execution_id")
        if not isinstance(eid, str) or not eid or len(eid) > 256:
            raise RequestError(400, "execution_id: expected a non-empty string of at most 256 characters")
        task, group = body.get("task", ""), body.get("group", 0)
        if not isinstance(task, str) or len(task) > 256:
            raise RequestError(400, "task: expected a string of at most 256 characters", param="task")
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < 2**63:
            raise RequestError(400, f"group: expected a non-negative integer, got {json.dumps(group)[:40]}",
                               param="group")
        unknown = sorted(set(body) - {"execution_id", "task", "group"})
        if unknown:
            raise RequestError(400, f"unknown field(s) {', '.join(unknown)[:200]}; known: execution_id, task, group")
        try:
            key = proxy.register(eid, task, group)
        except TooManyExecutions as e:
            raise RequestError(429, str(e), code="too_many_executions")
        except ValueError as e:
            raise RequestError(409, str(e))
        return web.json_response({"execution_id": eid, "api_key": key})

    async def stats(request: web.Request) -> web.Response:
        require_admin(request)
        sess = proxy.by_id.get(request.match_info["eid"])
        if sess is None:
            raise RequestError(404, f"no running execution {request.match_info['eid']!r}", "not_found")
        return web.json_response({"execution_id": sess.record.execution_id, **sess.tree.stats().as_dict()})

    async def end(request: web.Request) -> web.Response:
        """End an execution (its key is revoked, its calls in flight aborted) and hand its record to
        `on_end`: the route a standalone proxy's user ends a harness run with."""
        require_admin(request)
        eid = request.match_info["eid"]
        body = await _read_json(request) if request.can_read_body else {}
        status, reward = body.get("status", "done"), body.get("reward")
        if status not in FINISHED:
            raise RequestError(400, f"status: {status!r} is not one of {', '.join(FINISHED)}", param="status")
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
            raise RequestError(400, f"reward: expected a number, got {json.dumps(reward)[:40]}", param="reward")
        unknown = sorted(set(body) - {"status", "reward"})
        if unknown:
            raise RequestError(400, f"unknown field(s) {', '.join(unknown)[:200]}; known: status, reward")
        if eid not in proxy.by_id:
            raise RequestError(404, f"no running execution {eid!r}", "not_found")
        rec = proxy.end(eid, status)
        if reward is not None:
            rec.reward, rec.reward_source = float(reward), "client"
        out = {"execution_id": eid, "status": rec.status, **rec.tree.stats().as_dict()}
        if on_end is not None:
            out.update(await asyncio.to_thread(on_end, rec))
        return web.json_response(out)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def stats_all(request: web.Request) -> web.Response:
        require_admin(request)
        out = {"executions": len(proxy.by_id), "calls": proxy.calls_total,
               "abandoned": dict(proxy.abandoned), "overhead": proxy.overhead_percentiles()}
        if request.query.get("reset") == "1":  # start a new measurement window (benchmarks)
            proxy.overhead_s.clear()
        return web.json_response(out)

    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/gyre/executions", register)
    app.router.add_get("/gyre/executions/{eid}", stats)
    app.router.add_post("/gyre/executions/{eid}/end", end)
    app.router.add_get("/gyre/stats", stats_all)
    app.router.add_get("/health", health)
    return app


async def start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Start serving `app`; returns the runner and the bound port (port 0 = any free port)."""
    # handler_cancellation: a client that disconnects cancels its handler, which aborts the
    # engine request (aiohttp's default since 3.9 lets the handler run on unseen).
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # aiohttp exposes no public accessor
    return runner, bound


def run_forever(coro) -> None:
    asyncio.run(coro)
