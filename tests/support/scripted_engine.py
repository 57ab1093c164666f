"""A scripted stand-in for the engine's /generate (a real HTTP server on loopback).

Proxy tests need outputs they choose: a tool call, a non-canonical tokenization, unreadable
JSON. Everything else in those tests is the real proxy, router and client. It answers as SGLang
does where the proxy depends on it: streamed chunks (cumulative), stop strings ending the
output in the engine, ``/abort_request`` by rid, the context-length 400, ``/get_server_info``.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web


class ScriptedEngine:
    def __init__(self, decode=None, context_length: int = 32768) -> None:
        self.script: list[list[int]] = []   # output ids to return, in order; the last one repeats
        self.requests: list[dict] = []
        self.weight_version = "0"
        self.decode = decode  # ids -> text, for stop strings
        self.context_length = context_length
        self.token_delay_s = 0.0  # pause before each token (streamed or not): a slow generation
        self.gate: asyncio.Event | None = None  # when set, generation waits for it before the first token
        self.started = 0  # generations that began
        self.aborted: list[str] = []  # rids aborted through /abort_request
        self.disconnected: list[str] = []  # rids whose client went away mid-generation
        self.abort_next = 0  # this many coming generations end in finish_reason abort (e.g. abort_all)
        self._live: dict[str, asyncio.Event] = {}

    def _output(self, body: dict) -> tuple[list[int], dict]:
        out = list(self.script.pop(0) if len(self.script) > 1 else self.script[0])
        sp = body.get("sampling_params") or {}
        stop_ids = set(sp.get("stop_token_ids") or [])
        out = out[: sp.get("max_new_tokens") or len(out)]
        for k, t in enumerate(out):
            if t in stop_ids:
                return out[: k + 1], {"type": "stop", "matched": t}
            if sp.get("stop") and self.decode is not None:
                text = self.decode(out[: k + 1])
                hit = next((s for s in sp["stop"] if s in text), None)
                if hit is not None:
                    return out[: k + 1], {"type": "stop", "matched": hit}
        return out, {"type": "length", "length": len(out)}

    def _payload(self, body: dict, ids: list[int], reason: dict | None) -> dict:
        meta = {"output_token_logprobs": [[-0.5, t, None] for t in ids],
                "finish_reason": reason, "weight_version": self.weight_version,
                "prompt_tokens": len(body["input_ids"]), "completion_tokens": len(ids), "id": body.get("rid")}
        n = body.get("top_logprobs_num") or 0
        if n:  # the sampled token first, then made-up runners-up
            meta["output_top_logprobs"] = [[[-0.5 - k, t + k, None] for k in range(n)] for t in ids]
        return {"output_ids": ids, "text": "", "meta_info": meta}

    def app(self) -> web.Application:
        app = web.Application()

        async def generate(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self.requests.append(body)
            if len(body["input_ids"]) >= self.context_length:
                return web.json_response({"error": {"message": f"The input ({len(body['input_ids'])} tokens) is longer "
                                                    f"than the model's context length ({self.context_length} tokens)."}},
                                         status=400)
            out, reason = self._output(body)
            rid = body.get("rid") or "x"
            abort = self._live[rid] = asyncio.Event()
            self.started += 1
            if self.abort_next:
                self.abort_next -= 1
                abort.set()
            stream = body.get("stream", False)
            resp = None
            if stream:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
            try:
                if self.gate is not None:
                    await self.gate.wait()
                for k in range(len(out)):
                    if self.token_delay_s:
                        await asyncio.sleep(self.token_delay_s)
                    if abort.is_set():
                        out, reason = out[:k], {"type": "abort", "message": "Abort request"}
                        break
                    if stream and k + 1 < len(out):
                        await resp.write(b"data: " + json.dumps(self._payload(body, out[: k + 1], None)).encode() + b"\n\n")
            except asyncio.CancelledError:
                self.disconnected.append(rid)
                raise
            finally:
                self._live.pop(rid, None)
            final = self._payload(body, out, reason)
            if not stream:
                return web.json_response(final)
            await resp.write(b"data: " + json.dumps(final).encode() + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
            return resp

        async def abort_request(request: web.Request) -> web.Response:
            body = await request.json()
            for rid, ev in list(self._live.items()):
                if body.get("abort_all") or rid == body.get("rid"):
                    self.aborted.append(rid)
                    ev.set()
            return web.Response(status=200)

        async def health(request: web.Request) -> web.Response:
            return web.Response(status=200)

        async def server_info(request: web.Request) -> web.Response:
            return web.json_response({"context_length": self.context_length,
                                      "max_req_input_len": self.context_length - 1})

        app.router.add_post("/generate", generate)
        app.router.add_post("/abort_request", abort_request)
        app.router.add_get("/health", health)
        app.router.add_get("/get_server_info", server_info)
        return app
