"""The proxy's HTTP face: OpenAI's chat route and model list, the admin routes, the error shape.

Client mistakes come back as OpenAI-shaped 4xx, engine faults as 503, a bug in the proxy as one
500 (never a dead proxy). The admin routes (register, stats, end) are guarded by the job's admin
key; everything else by the execution's own key (`Proxy.session_for`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from typing import Any, Callable

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError
from aiohttp.web_protocol import RequestPayloadError

from gyre.proxy.call import AbortedCall, TooManyExecutions
from gyre.proxy.chat import MessageError
from gyre.proxy.json_body import parse_json
from gyre.proxy.params import RequestError
from gyre.traj.record import FINISHED, ExecutionRecord

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


def create_app(proxy, *, admin_key: str, max_body_bytes: int = 8 << 20,
               on_end: Callable[[ExecutionRecord], dict] | None = None) -> web.Application:
    """The HTTP application serving `proxy` (a gyre.proxy.server.Proxy). `on_end`: what POST
    /gyre/executions/{eid}/end does with the ended record (a standalone proxy writes it to a
    shard, off the event loop); None: the route only ends the execution."""
    app = web.Application(client_max_size=max_body_bytes, middlewares=[_errors(max_body_bytes)])

    async def stop_parsers(app: web.Application) -> None:  # the body parser processes end with the server
        await asyncio.to_thread(proxy.workers.close_parsers)  # joining them blocks
    app.on_cleanup.append(stop_parsers)

    routes = _Routes(proxy, admin_key, on_end)
    app.router.add_post("/v1/chat/completions", routes.chat)
    app.router.add_get("/v1/models", routes.models)
    app.router.add_post("/gyre/executions", routes.register)
    app.router.add_get("/gyre/executions/{eid}", routes.stats)
    app.router.add_post("/gyre/executions/{eid}/end", routes.end)
    app.router.add_get("/gyre/stats", routes.stats_all)
    app.router.add_get("/health", routes.health)
    return app


def _errors(max_body_bytes: int):
    """The middleware that turns every failure of a route into OpenAI's error shape."""
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
    return errors


class _Routes:
    """The route handlers over one proxy; the admin ones need the job's admin key."""

    def __init__(self, proxy, admin_key: str, on_end: Callable[[ExecutionRecord], dict] | None):
        self.proxy, self.admin_key, self.on_end = proxy, admin_key, on_end

    async def chat(self, request: web.Request) -> web.StreamResponse:
        t0, proxy = time.perf_counter(), self.proxy
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

    async def models(self, request: web.Request) -> web.Response:
        self.proxy.session_for(request.headers.get("Authorization"))
        names = [self.proxy.model_name, "main", "compactor"]
        return web.json_response({"object": "list", "data": [
            {"id": n, "object": "model", "created": 0, "owned_by": "gyre"} for n in names]})

    def require_admin(self, request: web.Request) -> None:
        auth = request.headers.get("Authorization", "")
        if not hmac.compare_digest(auth.encode(), f"Bearer {self.admin_key}".encode()):
            raise RequestError(401, "admin routes need the job's admin key", "authentication_error")

    async def register(self, request: web.Request) -> web.Response:
        self.require_admin(request)
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
            key = self.proxy.register(eid, task, group)
        except TooManyExecutions as e:
            raise RequestError(429, str(e), code="too_many_executions")
        except ValueError as e:
            raise RequestError(409, str(e))
        return web.json_response({"execution_id": eid, "api_key": key})

    async def stats(self, request: web.Request) -> web.Response:
        self.require_admin(request)
        sess = self.proxy.by_id.get(request.match_info["eid"])
        if sess is None:
            raise RequestError(404, f"no running execution {request.match_info['eid']!r}", "not_found")
        return web.json_response({"execution_id": sess.record.execution_id, **sess.tree.stats().as_dict()})

    async def end(self, request: web.Request) -> web.Response:
        """End an execution (its key is revoked, its calls in flight aborted) and hand its record to
        `on_end`: the route a standalone proxy's user ends a harness run with."""
        self.require_admin(request)
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
        if eid not in self.proxy.by_id:
            raise RequestError(404, f"no running execution {eid!r}", "not_found")
        rec = self.proxy.end(eid, status)
        if reward is not None:
            rec.reward, rec.reward_source = float(reward), "client"
        out = {"execution_id": eid, "status": rec.status, **rec.tree.stats().as_dict()}
        if self.on_end is not None:
            out.update(await asyncio.to_thread(self.on_end, rec))
        return web.json_response(out)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def stats_all(self, request: web.Request) -> web.Response:
        self.require_admin(request)
        out = {"executions": len(self.proxy.by_id), "calls": self.proxy.calls_total,
               "abandoned": dict(self.proxy.abandoned), "overhead": self.proxy.overhead_percentiles()}
        if request.query.get("reset") == "1":  # start a new measurement window (benchmarks)
            self.proxy.overhead_s.clear()
        return web.json_response(out)


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
