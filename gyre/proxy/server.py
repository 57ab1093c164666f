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
import json
import logging
import time
import uuid
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from aiohttp import web

from gyre.config import History, TemplateSource
from gyre.engine.client import EngineError
from gyre.engine.router import RouterError
from gyre.model.chat_template import ChatTemplate, end_token_ids
from gyre.model.tokenizer import load_tokenizer
from gyre.proxy import recording, relay
from gyre.proxy.body import over_bound, parse_chat_body, prompt_chars, refusal
from gyre.proxy.call import Call, TooManyExecutions, context_error, engine_failure
from gyre.proxy.capture import ExecutionSession, Renderer, message_keys, new_api_key, prepare_call, wire_ids
from gyre.proxy.chat import DEFAULT_TOOL_SYSTEM, Message, parse_messages, validate_tools
from gyre.proxy.fairness import CallGate
from gyre.proxy.journal import Journal
from gyre.proxy.offload import BIG_BODY_BYTES, INLINE_CHARS, PrepareWorkers, max_token_chars, text_chars
from gyre.proxy.params import MAX_DEPTH, RequestError, check_depth, forced_prefix, parse_params
from gyre.proxy.sampling import SamplingPolicy, budget_left
from gyre.proxy.replay import Replay
from gyre.proxy.template_capture import check_template, prepare_call_template
from gyre.proxy.token_safety import check_names, template_tokens
from gyre.traj.record import ExecutionRecord
from gyre.traj.tree import TrajectoryTree

log = logging.getLogger("gyre.proxy")


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
    """Sessions, rendering and capture; `gyre.proxy.routes.create_app` exposes it over HTTP."""

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
                 replay: TrajectoryTree | Replay | None = None, sampling: SamplingPolicy | None = None,
                 on_budget_spent=None) -> str:
        """A key for a new execution; ``replay``: the tree a stopped run of it recorded (or the
        Replay of a killed run's journal), whose calls are answered again where the resumed
        harness asks the same (gyre.proxy.replay). ``sampling``: its own sampling policy (e.g. a
        validation execution's); None: the proxy's. ``on_budget_spent``: called once, with no
        arguments, when a call is refused for proxy.execution_token_budget (gyre.proxy.sampling)."""
        if execution_id in self.by_id:
            raise ValueError(f"execution {execution_id!r} is already registered")
        if len(self.by_id) >= self.max_executions:
            raise TooManyExecutions(f"{len(self.by_id)} executions are registered, the limit "
                                    f"(proxy.max_executions) is {self.max_executions}; end some first")
        key = api_key or new_api_key()
        sess = ExecutionSession(ExecutionRecord(execution_id, task, group, t_start=time.time()), key,
                                replay=replay if isinstance(replay, Replay) and replay.recorded else
                                Replay(replay) if isinstance(replay, TrajectoryTree) and replay.calls else None)
        sess.sampling, sess.on_budget_spent = sampling, on_budget_spent
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
    def track(self, c: "Call"):
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

    def generate_args(self, c: Call) -> tuple:
        """The engine call's arguments: execution id, the input ids as sent (their JSON), sampling."""
        return (c.sess.record.execution_id, wire_ids(c.sess, c.prepared, c.forced), c.engine_params)

    def engine_for(self, c: Call, args: tuple):
        """The router, or (a resumed execution) the recorded answer to these exact input ids."""
        replay = c.sess.replay
        hit = replay.match(args[1]) if replay is not None else None
        return self.router if hit is None else hit

    def finish(self, c: Call, res) -> tuple[dict, Any]:
        """Record a finished generation and build the OpenAI response (gyre.proxy.recording)."""
        return recording.finish(self, c, res)

    async def complete(self, c: Call) -> dict:
        """Run one call to the end (non-streamed); returns the OpenAI response."""
        try:
            args = self.generate_args(c)  # the input ids' JSON, built once per call
            c.wire = args[1]
            with self.track(c):
                res = await self.engine_for(c, args).generate(*args, rid=c.rid, top_logprobs_num=c.params.top_logprobs,
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
        """Stream one call: content deltas as tokens come, tool calls and usage at the end
        (gyre.proxy.relay)."""
        await relay.stream(self, c, out)

    def overhead_percentiles(self) -> dict:
        if not self.overhead_s:
            return {"calls": 0}
        ms = sorted(x * 1e3 for x in self.overhead_s)
        pick = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]
        return {"calls": len(ms), "p50_ms": pick(0.5), "p99_ms": pick(0.99), "mean_ms": sum(ms) / len(ms)}

