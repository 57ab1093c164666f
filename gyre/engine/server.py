"""HTTP front of the embedded engine: SGLang's RL subset with SGLang's field names.

Routes (all require ``Authorization: Bearer KEY`` when the server has an API key; else 401):

* ``POST /generate`` ``{input_ids: [int], sampling_params: {max_new_tokens, temperature, top_p,
  top_k, stop_token_ids, ignore_eos, skip_special_tokens, sampling_seed}, return_logprob, rid}``
  -> ``{output_ids, text, meta_info: {id, finish_reason: {type: stop|length|abort, ...},
  weight_version, prompt_tokens, completion_tokens, cached_tokens, e2e_latency,
  output_token_logprobs: [[logprob, token_id, token_text], ...] (when return_logprob)}}``.
  A stop token (from ``stop_token_ids``, or the model's EOS unless ``ignore_eos``) that ends
  generation IS the last element of ``output_ids`` and has its log-prob; ``text`` leaves it out
  (and, with ``skip_special_tokens`` (default true), all special tokens). Log-probs: see
  :mod:`gyre.engine.sampling`. An aborted request answers 200 with ``finish_reason.type ==
  "abort"`` and the tokens generated so far. While memory is released: 503.
* ``POST /abort_request`` ``{rid}`` or ``{abort_all: true}``.
* ``POST /release_memory_occupation`` / ``POST /resume_memory_occupation`` ``{tags: [kv_cache,
  weights]}`` (missing/null = both). Release answers 400 while requests run or wait, as SGLang.
  Released weights are freed; resume reloads them from the current model path.
* ``POST /update_weights_from_disk`` ``{model_path, weight_version, abort_all_requests}``: loads
  while requests run, then waits for them to finish before swapping (queued ones wait).
* ``POST /flush_cache`` (400 while requests run), ``GET /health`` (``{status: ok, running,
  queued, prefix_cache_tokens}``), ``GET /get_weight_version``,
  ``GET /get_model_info`` (model path, identity hashes, weight version, vocab, limits).

Errors are JSON ``{"error": {"message": ..., "code": status}}``: malformed JSON, non-UTF-8 bodies,
wrong types, unknown keys, ids outside the vocabulary (400), bodies over the limit (413), unknown
routes (404), wrong methods (405). The server keeps serving after any of them.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import sys
import traceback
import uuid

from aiohttp import web

from gyre.engine.runtime import MEMORY_TAGS, Engine, Finished, Refused
from gyre.engine.sampling import BadRequest, parse_sampling_params

READY_MARKER = "GYRE_ENGINE_LISTENING"
ENGINE_KEY = web.AppKey("engine", Engine)
LIMIT_KEY = web.AppKey("max_body_bytes", int)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except BadRequest as e:
        return _error(400, str(e))
    except Refused as e:
        return _error(e.status, e.message)
    except web.HTTPRequestEntityTooLarge:
        return _error(413, f"request body too large: the limit is {request.app[LIMIT_KEY]} bytes "
                           "(engine.max_body_bytes)")
    except web.HTTPNotFound:
        return _error(404, f"unknown route {request.method} {request.path}")
    except web.HTTPMethodNotAllowed as e:
        return _error(405, f"{request.method} is not allowed on {request.path}; use {', '.join(sorted(e.allowed_methods))}")
    except web.HTTPException as e:
        return _error(e.status, e.text or e.reason)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # a bug must cost one request, not the server
        traceback.print_exc()
        return _error(500, f"internal error: {type(e).__name__}: {e}")


def _auth(api_key: str | None):
    expected = f"Bearer {api_key}".encode() if api_key else None

    @web.middleware
    async def check(request: web.Request, handler):
        if expected is not None:
            got = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(got, expected):
                return web.json_response({"error": {"message": "missing or wrong API key (Authorization: Bearer ...)",
                                                    "code": 401}}, status=401,
                                         headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return check


async def _body(request: web.Request, allowed: set[str]) -> dict:
    raw = await request.read()
    if not raw:
        return {}
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRequest(f"malformed JSON: {e}") from None
    if not isinstance(data, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise BadRequest(f"unknown key(s) {unknown}; this route accepts {sorted(allowed)}")
    return data


def _tags(data: dict) -> list[str]:
    tags = data.get("tags")
    if tags is None:
        return list(MEMORY_TAGS)
    if not isinstance(tags, list) or not all(t in MEMORY_TAGS for t in tags):
        raise BadRequest(f"tags must be a list drawn from {list(MEMORY_TAGS)}, got {tags!r}")
    return tags


def _render(engine: Engine, res: Finished, return_logprob: bool, skip_special: bool) -> dict:
    tok = engine.tokenizer
    text_ids = res.output_ids[:-1] if res.finish_reason.get("type") == "stop" else res.output_ids
    meta = {
        "id": res.rid, "finish_reason": res.finish_reason, "weight_version": res.weight_version,
        "prompt_tokens": res.prompt_tokens, "completion_tokens": len(res.output_ids),
        "cached_tokens": res.cached_tokens, "e2e_latency": res.e2e_latency_s,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, t, tok.decode([t], skip_special_tokens=False)]
                                         for lp, t in zip(res.logprobs, res.output_ids)]
    return {"text": tok.decode(text_ids, skip_special_tokens=skip_special), "output_ids": res.output_ids,
            "meta_info": meta}


# SGLang GenerateReqInput fields that sglang-router (and SGLang clients) send with every request:
# accepted and ignored, or accepted only when off. Anything else is an unknown key (400).
_GENERATE_IGNORED = {"model", "return_text_in_logprobs", "log_metrics", "no_logs", "priority", "extra_key",
                     "custom_labels", "data_parallel_rank"}
_GENERATE_OFF = {"stream", "background", "return_hidden_states", "return_bytes", "return_entropy",
                 "top_logprobs_num", "lora_path", "image_data", "input_embeds"}
_GENERATE_FIELDS = {"input_ids", "sampling_params", "return_logprob", "rid", "logprob_start_len"}


async def generate(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    data = await _body(request, _GENERATE_FIELDS | _GENERATE_IGNORED | _GENERATE_OFF)
    on = sorted(k for k in _GENERATE_OFF if data.get(k) not in (None, False, 0))
    if on:
        raise BadRequest(f"{on} not supported by the embedded engine (send them off or leave them out)")
    if data.get("logprob_start_len") not in (None, -1):
        raise BadRequest("logprob_start_len is not supported (the engine returns output log-probs only)")
    ids = data.get("input_ids")
    if ids is None:
        raise BadRequest("input_ids is required (this engine takes token ids, not text)")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        raise BadRequest("batched input_ids (a list of lists) are not supported; send one request per sequence")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise BadRequest("input_ids must be a non-empty list of integers")
    bad = next((t for t in ids if not 0 <= t < engine.vocab_size), None)
    if bad is not None:
        raise BadRequest(f"input_ids contains {bad}, outside the vocabulary [0, {engine.vocab_size})")
    return_logprob = data.get("return_logprob", False)
    if not isinstance(return_logprob, bool):
        raise BadRequest(f"return_logprob must be true or false, got {return_logprob!r}")
    rid = data.get("rid")
    if rid is None:
        rid = uuid.uuid4().hex
    elif not isinstance(rid, str) or not rid:
        raise BadRequest(f"rid must be a non-empty string, got {rid!r}")
    params = parse_sampling_params(data.get("sampling_params"), engine.vocab_size, engine.max_new_tokens_cap)

    loop = asyncio.get_running_loop()
    done: asyncio.Future[Finished] = loop.create_future()

    def on_done(res: Finished) -> None:  # worker thread -> event loop
        loop.call_soon_threadsafe(lambda: done.done() or done.set_result(res))

    engine.submit(rid, ids, params, on_done)
    try:
        res = await done
    except asyncio.CancelledError:  # the client went away: stop spending compute on it
        engine.abort(rid=rid, message="client disconnected")
        raise
    return web.json_response(_render(engine, res, return_logprob, params.skip_special_tokens))


async def abort_request(request: web.Request) -> web.Response:
    data = await _body(request, {"rid", "abort_all"})
    rid, abort_all = data.get("rid"), data.get("abort_all", False)
    if not isinstance(abort_all, bool):
        raise BadRequest(f"abort_all must be true or false, got {abort_all!r}")
    if rid is not None and not isinstance(rid, str):
        raise BadRequest(f"rid must be a string, got {rid!r}")
    if rid is None and not abort_all:
        raise BadRequest("give rid or abort_all: true")
    n = request.app[ENGINE_KEY].abort(rid=rid, abort_all=abort_all)
    return web.json_response({"success": True, "aborted": n})


async def release_memory(request: web.Request) -> web.Response:
    tags = _tags(await _body(request, {"tags"}))
    await asyncio.to_thread(request.app[ENGINE_KEY].release, tags)
    return web.json_response({"success": True, "message": f"released {tags}"})


async def resume_memory(request: web.Request) -> web.Response:
    tags = _tags(await _body(request, {"tags"}))
    await asyncio.to_thread(request.app[ENGINE_KEY].resume, tags)
    return web.json_response({"success": True, "message": f"resumed {tags}"})


async def update_weights_from_disk(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    data = await _body(request, {"model_path", "weight_version", "abort_all_requests", "load_format"})
    path, version = data.get("model_path"), data.get("weight_version")
    if not isinstance(path, str) or not path:
        raise BadRequest("model_path must be a non-empty string (a directory in transformers layout)")
    if version is not None and not isinstance(version, str):
        raise BadRequest(f"weight_version must be a string, got {version!r}")
    if data.get("load_format") not in (None, "auto", "safetensors"):
        raise BadRequest(f"load_format {data['load_format']!r} is not supported (auto, safetensors)")
    abort_all = data.get("abort_all_requests", False)
    if not isinstance(abort_all, bool):
        raise BadRequest(f"abort_all_requests must be true or false, got {abort_all!r}")
    try:
        waited = await asyncio.to_thread(engine.update_weights_from_disk, path, version, abort_all)
    except Refused as e:  # SGLang answers {success: false, message} with 400
        return web.json_response({"success": False, "message": e.message,
                                  "error": {"message": e.message, "code": e.status}}, status=e.status)
    return web.json_response({"success": True, "message": f"loaded {path}", "weight_version": engine.weight_version,
                              "num_paused_requests": waited})


async def flush_cache(request: web.Request) -> web.Response:
    await _body(request, set())
    request.app[ENGINE_KEY].flush_cache()
    return web.json_response({"success": True, "message": "cache flushed"})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", **request.app[ENGINE_KEY].load()})


async def get_weight_version(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": request.app[ENGINE_KEY].weight_version})


async def get_model_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    ident = await asyncio.to_thread(engine.identity)
    return web.json_response({
        "model_path": str(engine.model_dir), "tokenizer_path": str(engine.model_dir / "tokenizer.json"),
        "is_generation": True, "engine": "gyre-embedded", "weight_version": engine.weight_version,
        "identity": ident, "model_hash": ident.get("model_hash"), "tokenizer_hash": ident.get("tokenizer_hash"),
        "vocab_size": engine.vocab_size, "max_context_length": engine.max_context,
        "max_new_tokens_cap": engine.max_new_tokens_cap, "max_running_requests": engine.max_running,
    })


def make_app(engine: Engine, api_key: str | None = None, max_body_bytes: int = 8 << 20) -> web.Application:
    app = web.Application(middlewares=[_errors, _auth(api_key)], client_max_size=max_body_bytes)
    app[ENGINE_KEY] = engine
    app[LIMIT_KEY] = max_body_bytes
    app.router.add_post("/generate", generate)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_post("/release_memory_occupation", release_memory)
    app.router.add_post("/resume_memory_occupation", resume_memory)
    app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
    app.router.add_post("/flush_cache", flush_cache)
    # /get_server_info, /server_info and /model_info: what sglang-router asks when a worker joins.
    for path, handler in (("/health", health), ("/get_weight_version", get_weight_version),
                          ("/get_model_info", get_model_info), ("/model_info", get_model_info),
                          ("/get_server_info", get_model_info), ("/server_info", get_model_info)):
        app.router.add_get(path, handler)
    return app


class EngineServer:
    """The HTTP server for an :class:`Engine`, started inside a running event loop."""

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                 max_body_bytes: int = 8 << 20):
        self.engine, self.host, self.port = engine, host, port
        # handler_cancellation: a client that disconnects aborts its request (like SGLang).
        self._runner = web.AppRunner(make_app(engine, api_key, max_body_bytes), access_log=None,
                                     handler_cancellation=True)
        self.url = ""

    async def start(self) -> str:
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # the real port when asked for 0
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        self.url = f"http://{host}:{port}"
        return self.url

    async def close(self) -> None:
        await self._runner.cleanup()


async def serve(engine: Engine, host: str, port: int, api_key: str | None, max_body_bytes: int) -> None:
    """Serve until cancelled (SIGINT/SIGTERM); print the ready marker once listening."""
    server = EngineServer(engine, host, port, api_key, max_body_bytes)
    url = await server.start()
    ident = await asyncio.to_thread(engine.identity)
    print(f"gyre engine: serving {engine.model_dir} (model_hash {ident.get('model_hash', '?')[:16]}, "
          f"weight_version {engine.weight_version}) at {url}", file=sys.stderr, flush=True)
    print(f"{READY_MARKER} {url}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        engine.close()  # first: running requests end (abort) so their handlers can answer
        await server.close()
        print("engine stopped", file=sys.stderr, flush=True)
