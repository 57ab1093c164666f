"""The token-in/token-out proxy: an OpenAI-compatible endpoint in front of the engine router.

Harnesses speak OpenAI chat; the proxy renders with exact token reuse, calls the engine with
``input_ids`` (never text), records every call into the execution's trajectory tree, and
answers in OpenAI's format (JSON or SSE). Each execution has its own API key; the key decides
which tree a call lands in. Head-side code registers and ends executions through the `Proxy`
object or the admin routes (guarded by the job's admin key).
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gyre.proxy.capture import (ExecutionSession, PreparedCall, Renderer, new_api_key,
                                prepare_call, record_call)
from gyre.proxy.chat import Message, MessageError, parse_messages, parse_output, validate_tools
from gyre.traj.record import ExecutionRecord

log = logging.getLogger("gyre.proxy")

ROLE_HEADER = "X-Gyre-Role"
_ROLE_MODELS = ("main", "compactor")


def agent_role_of(model: Any, header: str | None) -> str:
    """Agent role from the X-Gyre-Role header, else from the model name, else `main`."""
    if header:
        return header.strip()[:128]
    if isinstance(model, str) and (model in _ROLE_MODELS or model.startswith("subagent:")):
        return model[:128]
    return "main"


class RequestError(Exception):
    def __init__(self, status: int, message: str, code: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def _error(status: int, message: str, code: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": code, "code": status}}, status=status)


@dataclass
class SamplingRequest:
    max_new_tokens: int
    temperature: float
    top_p: float
    stop: list[str]
    stream: bool
    include_usage: bool


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise RequestError(400, f"{name}: expected a number in [{lo}, {hi}], got {v!r}")
    return float(v)


def parse_sampling(body: dict, default_max: int, cap: int) -> SamplingRequest:
    n = body.get("n", 1)
    if n not in (1, None):
        raise RequestError(400, f"n: only n=1 is supported (got {n!r}); send n separate requests instead")
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    if mt is None:
        mt = default_max
    if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
        raise RequestError(400, f"max_tokens: expected a positive integer, got {mt!r}")
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
        raise RequestError(400, "stop: expected a non-empty string or a list of up to 16 non-empty strings")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, f"stream: expected true or false, got {stream!r}")
    opts = body.get("stream_options") or {}
    return SamplingRequest(
        max_new_tokens=min(mt, cap),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0) or 1.0,
        stop=stop, stream=stream,
        include_usage=bool(isinstance(opts, dict) and opts.get("include_usage")))


def truncate_at_stop(r: Renderer, ids: list[int], lps: list[float], stop: list[str]) -> tuple[list[int], list[float], bool]:
    """Cut the output after the first token that completes a stop string (OpenAI `stop`).

    The kept tokens are exactly what was sampled, so training on them stays token-true.
    """
    if not stop:
        return ids, lps, False
    text = ""
    for k in range(len(ids)):
        text += r.decode([ids[k]])
        if any(s in text for s in stop):
            return ids[: k + 1], lps[: k + 1], True
    return ids, lps, False


class Proxy:
    """Sessions, rendering and capture; `create_app` exposes it over HTTP."""

    def __init__(self, router, tokenizer, *, model_name: str = "gyre", default_max_tokens: int = 512,
                 max_tokens_cap: int = 4096, identity: dict | None = None):
        self.router = router
        self.renderer = Renderer(tokenizer)
        self.model_name = model_name
        self.default_max_tokens, self.max_tokens_cap = default_max_tokens, max_tokens_cap
        self.identity = identity or {}
        self.sessions: dict[str, ExecutionSession] = {}  # api key -> session
        self.by_id: dict[str, ExecutionSession] = {}
        self.calls_total = 0
        # seconds each call spent in the proxy itself (handler time minus the engine round trip)
        self.overhead_s: collections.deque[float] = collections.deque(maxlen=100_000)

    # -- execution registry (head side) ---------------------------------------------------
    def register(self, execution_id: str, task: str = "", group: int = 0, api_key: str | None = None) -> str:
        if execution_id in self.by_id:
            raise ValueError(f"execution {execution_id!r} is already registered")
        key = api_key or new_api_key()
        sess = ExecutionSession(ExecutionRecord(execution_id, task, group, t_start=time.time()), key)
        self.sessions[key] = sess
        self.by_id[execution_id] = sess
        return key

    def end(self, execution_id: str, status: str = "done") -> ExecutionRecord:
        """Revoke the execution's key and hand back its record (tree included)."""
        sess = self.by_id.pop(execution_id)
        self.sessions.pop(sess.api_key, None)
        sess.ended = True
        sess.record.status, sess.record.t_end = status, time.time()
        return sess.record

    def session_for(self, auth: str | None) -> ExecutionSession:
        if not auth or not auth.startswith("Bearer "):
            raise RequestError(401, "missing API key: send 'Authorization: Bearer <execution key>'", "authentication_error")
        key = auth[7:].strip()
        sess = self.sessions.get(key)
        if sess is None:
            raise RequestError(401, "unknown or revoked API key", "authentication_error")
        return sess

    # -- one call -------------------------------------------------------------------------
    async def complete(self, sess: ExecutionSession, body: dict, role: str) -> tuple[dict, SamplingRequest, float]:
        """Run one call; returns the OpenAI response, the sampling request and engine seconds."""
        messages = parse_messages(body.get("messages"))
        tools = validate_tools(body.get("tools"))
        sp = parse_sampling(body, self.default_max_tokens, self.max_tokens_cap)
        prepared: PreparedCall = prepare_call(self.renderer, sess, messages, tools)
        params = {"max_new_tokens": sp.max_new_tokens, "temperature": sp.temperature, "top_p": sp.top_p,
                  "stop_token_ids": self.renderer.stop_ids()}
        rid = f"{sess.record.execution_id}-{uuid.uuid4().hex[:12]}"
        t0 = time.time()
        sess.in_flight += 1
        t_engine = time.perf_counter()
        try:
            res = await self.router.generate(sess.record.execution_id, prepared.input_ids, params, rid=rid)
        finally:
            sess.in_flight -= 1
        engine_s = time.perf_counter() - t_engine
        out_ids, lps = list(res.output_ids), list(res.logprobs)
        out_ids, lps, hit_stop = truncate_at_stop(self.renderer, out_ids, lps, sp.stop)
        text = self.renderer.decode(out_ids)
        if hit_stop:
            text = text[: min(text.find(s) for s in sp.stop if s in text)]
        parsed = parse_output(text)
        reply = Message("assistant", parsed.content or "", tuple(parsed.tool_calls))
        if sess.ended:  # the execution ended while its call ran: answer, but do not record
            raise RequestError(409, "execution ended while the call was running", "execution_ended")
        call = record_call(sess, prepared, reply, out_ids, lps, agent_role=role,
                           weight_version=str(res.weight_version), endpoint=res.endpoint,
                           finish_reason=res.finish_reason, t_start=t0)
        self.calls_total += 1
        finish = "tool_calls" if parsed.tool_calls else ("length" if res.finish_reason == "length" and not hit_stop else "stop")
        msg: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            msg["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:16]}", "type": "function",
                                  "function": {"name": t.name, "arguments": t.arguments}} for t in parsed.tool_calls]
        return {
            "id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(t0),
            "model": body.get("model") or self.model_name,
            "choices": [{"index": 0, "message": msg, "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": len(prepared.input_ids), "completion_tokens": len(out_ids),
                      "total_tokens": len(prepared.input_ids) + len(out_ids)},
            "gyre": {"call_index": call.index, "weight_version": call.weight_version, "reused_messages": prepared.n_reused},
        }, sp, engine_s

    def overhead_percentiles(self) -> dict:
        if not self.overhead_s:
            return {"calls": 0}
        ms = sorted(x * 1e3 for x in self.overhead_s)
        pick = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]
        return {"calls": len(ms), "p50_ms": pick(0.5), "p99_ms": pick(0.99), "mean_ms": sum(ms) / len(ms)}


def _sse_chunks(resp: dict, include_usage: bool) -> list[dict]:
    """One OpenAI completion as the chunk sequence a streaming client expects."""
    base = {"id": resp["id"], "object": "chat.completion.chunk", "created": resp["created"], "model": resp["model"]}
    choice = resp["choices"][0]
    msg = choice["message"]
    chunks = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
    if msg.get("content"):
        chunks.append({**base, "choices": [{"index": 0, "delta": {"content": msg["content"]}, "finish_reason": None}]})
    for i, tc in enumerate(msg.get("tool_calls") or []):
        delta = {"tool_calls": [{"index": i, "id": tc["id"], "type": "function",
                                 "function": {"name": tc["function"]["name"], "arguments": tc["function"]["arguments"]}}]}
        chunks.append({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
    chunks.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]})
    if include_usage:
        chunks.append({**base, "choices": [], "usage": resp["usage"]})
    return chunks


async def _read_json(request: web.Request) -> dict:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise RequestError(413, f"request body larger than the limit of {request.client_max_size} bytes "
                                f"(raise proxy.max_body_bytes if this is intended)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(400, f"request body is not valid UTF-8 (byte {e.start})")
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(400, f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}")
    if not isinstance(body, dict):
        raise RequestError(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body


def create_app(proxy: Proxy, *, admin_key: str, max_body_bytes: int = 8 << 20) -> web.Application:
    @web.middleware
    async def errors(request: web.Request, handler):
        try:
            return await handler(request)
        except RequestError as e:
            return _error(e.status, e.message, e.code)
        except MessageError as e:
            return _error(400, str(e))
        except web.HTTPException as e:
            if e.status == 413:
                return _error(413, f"request body larger than the limit of {max_body_bytes} bytes")
            if e.status in (404, 405):
                return _error(e.status, f"no route {request.method} {request.path}; "
                                        "this proxy serves POST /v1/chat/completions and GET /v1/models", "not_found")
            raise
        except Exception as e:  # an engine failure must reach the harness as a clean 5xx
            log.exception("call failed")
            return _error(503, f"model backend unavailable: {type(e).__name__}: {e}", "backend_error")

    app = web.Application(client_max_size=max_body_bytes, middlewares=[errors])

    async def chat(request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        sess = proxy.session_for(request.headers.get("Authorization"))
        body = await _read_json(request)
        resp, sp, engine_s = await proxy.complete(sess, body, agent_role_of(body.get("model"), request.headers.get(ROLE_HEADER)))
        if not sp.stream:
            out = web.json_response(resp)
            proxy.overhead_s.append(time.perf_counter() - t0 - engine_s)
            return out
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await out.prepare(request)
        for chunk in _sse_chunks(resp, sp.include_usage):
            await out.write(f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode())
        await out.write(b"data: [DONE]\n\n")
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
        try:
            key = proxy.register(eid, str(body.get("task", "")), int(body.get("group", 0)))
        except ValueError as e:
            raise RequestError(409, str(e))
        return web.json_response({"execution_id": eid, "api_key": key})

    async def stats(request: web.Request) -> web.Response:
        require_admin(request)
        sess = proxy.by_id.get(request.match_info["eid"])
        if sess is None:
            raise RequestError(404, f"no running execution {request.match_info['eid']!r}", "not_found")
        return web.json_response({"execution_id": sess.record.execution_id, **sess.tree.stats().as_dict()})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def stats_all(request: web.Request) -> web.Response:
        require_admin(request)
        return web.json_response({"executions": len(proxy.by_id), "calls": proxy.calls_total,
                                  "overhead": proxy.overhead_percentiles()})

    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/gyre/executions", register)
    app.router.add_get("/gyre/executions/{eid}", stats)
    app.router.add_get("/gyre/stats", stats_all)
    app.router.add_get("/health", health)
    return app


async def start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Start serving `app`; returns the runner and the bound port (port 0 = any free port)."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # aiohttp exposes no public accessor
    return runner, bound


def run_forever(coro) -> None:
    asyncio.run(coro)
