"""A scripted stand-in for the engine's /generate (a real HTTP server on loopback).

Proxy tests need outputs they choose: a tool call, a non-canonical tokenization, unreadable
JSON. Everything else in those tests is the real proxy, router and client.
"""

from __future__ import annotations

from aiohttp import web


class ScriptedEngine:
    def __init__(self) -> None:
        self.script: list[list[int]] = []   # output ids to return, in order; the last one repeats
        self.requests: list[dict] = []
        self.weight_version = "0"

    def app(self) -> web.Application:
        app = web.Application()

        async def generate(request: web.Request) -> web.Response:
            body = await request.json()
            self.requests.append(body)
            out = self.script.pop(0) if len(self.script) > 1 else self.script[0]
            stop = set(body["sampling_params"].get("stop_token_ids") or [])
            finish = "stop" if out and out[-1] in stop else "length"
            return web.json_response({
                "output_ids": out, "text": "",
                "meta_info": {"output_token_logprobs": [[-0.5, t, ""] for t in out],
                              "finish_reason": {"type": finish}, "weight_version": self.weight_version,
                              "prompt_tokens": len(body["input_ids"]), "completion_tokens": len(out),
                              "id": body.get("rid")}})

        async def health(request: web.Request) -> web.Response:
            return web.json_response({"ok": True})

        app.router.add_post("/generate", generate)
        app.router.add_get("/health", health)
        return app
