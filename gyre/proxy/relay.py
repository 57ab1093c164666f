"""The streaming relay: a call's tokens passed on as server-sent events as the engine makes them.

Content (or reasoning) deltas go out as snapshots come; what can only be known at the end (tool
calls, the text held back for a stop string, usage) goes out after the call is recorded
(gyre.proxy.recording). After the headers went out an error can only travel as an event.
`stream` is the `Proxy`'s (gyre.proxy.server) `stream`, taking it as its first argument.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from gyre.config import ReasoningParser
from gyre.engine.client import EngineError
from gyre.engine.router import RouterError
from gyre.proxy.call import AbortedCall, Call, engine_failure
from gyre.proxy.params import RequestError
from gyre.proxy.recording import logprob_entries
from gyre.proxy.streaming import ContentStream, ReasoningStream


async def stream(proxy, c: Call, out: web.StreamResponse) -> None:
    """Stream one call: content deltas as tokens come, tool calls and usage at the end."""
    p = c.params
    base = {"id": c.id, "object": "chat.completion.chunk", "created": int(c.t0),
            "model": c.body.get("model") or proxy.model_name}
    tools_on = bool(c.tools) and p.tool_choice != "none"
    content = ContentStream(c.engine_params.get("stop", []), tools_on)
    if c.forced:
        content.closed = True  # the whole output is a tool call
    reasoning = ReasoningStream(content) if proxy.template is not None and proxy.reasoning_parser != ReasoningParser.NONE \
        else None

    stop_ids = set(proxy.renderer.stop_ids())
    lp = {"sent": 0, "snap": None}  # logprobs: tokens already carried by a chunk, the newest snapshot

    async def send(delta: dict, finish: str | None = None, **extra) -> None:
        snap = lp["snap"]
        ids = snap.output_ids if snap is not None else []
        upto = len(ids) - (1 if ids and ids[-1] in stop_ids else 0)  # an end token has none (as unstreamed)
        if p.logprobs and finish is None and upto > lp["sent"]:
            # this chunk carries the log-probs of the tokens sampled since the last one
            extra["logprobs"] = {"content": logprob_entries(proxy, ids, snap, lp["sent"], upto), "refusal": None}
            lp["sent"] = upto
        chunk = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]}
        await out.write(b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n")

    await send({"role": "assistant", "content": ""})
    args = proxy.generate_args(c)
    c.wire = args[1]
    gen = proxy.engine_for(c, args).generate_stream(*args, rid=c.rid, top_logprobs_num=p.top_logprobs,
                                                priority=c.priority,
                                                return_routed_experts=proxy.routing is not None)
    try:
        with proxy.track(c):
            final = await _relay(proxy, c, gen, content, send, reasoning, lp)
    except (asyncio.CancelledError, ConnectionError):
        proxy.abandoned["client_disconnected"] += 1
        raise
    except (EngineError, RouterError) as e:
        await stream_error(out, engine_failure(e))
        return
    finally:
        await gen.aclose()
    if final is None and c.sess.ended:
        await stream_error(out, RequestError(409, "execution ended while the call was running",
                                                   code="execution_ended"))
        return
    if final is None:
        await stream_error(out, RequestError(503, "model backend ended the stream early", "server_error"))
        return
    try:
        async with proxy.workers.session(c.sess.record.execution_id):
            resp, parsed = proxy.finish(c, final)
    except AbortedCall as e:
        await stream_error(out, RequestError(503, f"generation aborted, retry: {e}", "server_error",
                                                   "generation_aborted"))
        return
    except RequestError as e:  # e.g. the execution ended while its call ran (409)
        await stream_error(out, e)
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


async def _relay(proxy, c: Call, gen, content: ContentStream, send, reasoning=None, lp: dict | None = None):
    """Pass content (or reasoning) deltas on as snapshots come; returns the final snapshot
    (None if none came). `lp["snap"]`: the newest snapshot, whose log-probs `send` attaches."""
    final = None
    async for snap in gen:  # the router ends after the final snapshot
        if snap.finish_reason is not None:
            final = snap
            continue
        if lp is not None:
            lp["snap"] = snap
        text = proxy.renderer.decode_output(c.forced + snap.output_ids)
        if reasoning is not None:
            delta = {k: v for k, v in reasoning.deltas(text).items() if v}
            if delta:
                await send(delta)
            continue
        delta = content.delta(text)
        if delta:
            await send({"content": delta})
    return final


async def stream_error(out: web.StreamResponse, e: RequestError) -> None:
    """After the headers went out, an error can only travel as an event (the openai SDK
    raises it as an APIError)."""
    body = {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}
    await out.write(b"data: " + json.dumps(body).encode() + b"\n\n")
    await out.write(b"data: [DONE]\n\n")  # the stream is over: a client must not wait for more
