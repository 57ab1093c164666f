"""HTTP front of the embedded engine: SGLang's RL subset, answering as SGLang's http_server does.

Routes (all require ``Authorization: Bearer KEY`` when the server has an API key; else 401):

* ``POST /generate`` ``{input_ids: [int], sampling_params: {max_new_tokens, temperature, top_p,
  top_k, min_p, stop, stop_token_ids, no_stop_trim, ignore_eos, skip_special_tokens, sampling_seed},
  return_logprob, top_logprobs_num, return_text_in_logprobs, rid, stream, priority}``
  (``priority``: admitted highest first, as SGLang with ``--enable-priority-scheduling``)
  -> ``{output_ids, text, meta_info: {id, finish_reason: {type: stop|length|abort, ...},
  weight_version, prompt_tokens, completion_tokens, cached_tokens, e2e_latency,
  output_token_logprobs: [[logprob, token_id, token_text|null], ...] (when return_logprob),
  routed_experts: base64 of int32 [prompt + output - 1, MoE layers, top_k] (when
  return_routed_experts, MoE models; in the finished answer only: the last chunk of a stream),
  output_top_logprobs: [[[logprob, token_id, text|null], ...], ...] (when top_logprobs_num)}}``.
  A stop token (from ``stop_token_ids``, or the model's EOS unless ``ignore_eos``) that ends
  generation IS the last element of ``output_ids`` and has its log-prob; ``text`` leaves it out
  (and, with ``skip_special_tokens`` (default true), all special tokens). A stop *string* ends
  generation in the engine (``matched`` is the string); ``text`` is cut before it unless
  ``no_stop_trim``. Log-probs: see :mod:`gyre.engine.sampling`. An aborted request answers 200
  with ``finish_reason.type == "abort"`` and the tokens generated so far. While memory is
  released: 503.
  ``stream: true``: ``text/event-stream`` of ``data: {same object}\n\n`` after every new token
  (``finish_reason`` null until the last), then ``data: [DONE]\n\n``. As SGLang by default each
  chunk is cumulative (``text``, ``output_ids`` and log-probs so far); with
  ``--incremental-streaming-output`` (SGLang's flag) each chunk carries only the new part.
  ``meta_info.completion_tokens`` is always the running total. Closing the connection aborts.
* ``POST /abort_request`` ``{rid}`` or ``{abort_all: true}`` -> empty 200.
* ``POST /release_memory_occupation`` / ``POST /resume_memory_occupation`` ``{tags: [kv_cache,
  weights]}`` (missing/null = both) -> ``null`` (as SGLang's handler, which returns nothing).
  Release answers 400 while requests run or wait. Released weights are freed; resume reloads
  them from the current model path with the checks of a weight update (checksum manifest,
  finiteness; only regular files are opened), and stays released with a 400 naming the problem.
* ``POST /update_weights_from_disk`` ``{model_path, weight_version, abort_all_requests}`` ->
  ``{success, message, num_paused_requests}`` (400 with ``success: false`` when refused). Loads
  while requests run, checks the checksum manifest (:mod:`gyre.model.checksums`) and that every
  tensor is finite, then waits for running requests to finish before swapping (queued ones
  wait). Refused weights leave the served ones in place.
* ``GET|POST /flush_cache`` -> SGLang's plain-text answer (400 while requests run).
* ``GET /health``, ``GET /health_generate`` -> empty 200 (503 while shutting down), as SGLang.
  How busy an engine is comes from the router (:meth:`gyre.engine.router.Router.in_flight`).
* ``GET /get_weight_version`` -> ``{weight_version}``; ``GET /get_model_info`` -> ``{model_path,
  tokenizer_path, is_generation, preferred_sampling_params, weight_version}``;
  ``GET /get_server_info`` (and ``/server_info``, ``/model_info``: sglang-router's probes).

Errors are JSON ``{"error": {"message": ..., "code": status}}``: malformed JSON, non-UTF-8 bodies,
wrong types, unknown keys, ids outside the vocabulary, prompts longer than the context (400),
bodies over the limit (413), unknown routes (404), wrong methods (405). The server keeps serving
after any of them.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import sys
import traceback
import uuid

from aiohttp import web

from gyre import faults
from gyre.engine.ready import READY_MARKER
from gyre.engine.runtime import MEMORY_TAGS, Engine, Finished, Refused
from gyre.engine.sampling import BadRequest, parse_sampling_params

ENGINE_KEY = web.AppKey("engine", Engine)
LIMIT_KEY = web.AppKey("max_body_bytes", int)
INCREMENTAL_KEY = web.AppKey("incremental_streaming_output", bool)
MAX_TOP_LOGPROBS = 20


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
    except RecursionError:
        raise BadRequest("JSON nested too deeply") from None
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


def _triples(engine: Engine, pairs, with_text: bool) -> list:
    dec = engine.tokenizer.decode
    return [[lp, t, dec([t], skip_special_tokens=False) if with_text else None] for lp, t in pairs]


def _text(engine: Engine, ids: list[int], reason: dict | None, params) -> str:
    """Output text as SGLang's detokenizer gives it: a matched stop token left out, a matched
    stop string cut off (unless no_stop_trim)."""
    matched = (reason or {}).get("matched") if (reason or {}).get("type") == "stop" else None
    if isinstance(matched, int) and not params.no_stop_trim:
        ids = ids[:-1]
    text = engine.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
    if isinstance(matched, str) and not params.no_stop_trim:
        pos = text.find(matched)
        text = text[:pos] if pos >= 0 else text
    return text


def _payload(engine: Engine, rid: str, ids: list[int], lps: list[float], tops: list, reason: dict | None,
             weight_version: str, prompt_tokens: int, cached: int, completion_tokens: int, text: str,
             opts: dict, latency: float | None = None) -> dict:
    meta = {"id": rid, "finish_reason": reason, "weight_version": weight_version,
            "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "cached_tokens": cached}
    if latency is not None:
        meta["e2e_latency"] = latency
    if opts.get("routed") is not None:  # SGLang: int32 [token, layer, top-k slot], base64
        meta["routed_experts"] = base64.b64encode(opts["routed"].numpy().astype("<i4").tobytes()).decode("ascii")
    if opts["return_logprob"]:
        meta["output_token_logprobs"] = _triples(engine, zip(lps, ids), opts["with_text"])
        if opts["top_n"]:
            meta["output_top_logprobs"] = [_triples(engine, top, opts["with_text"]) for top in tops]
    return {"text": text, "output_ids": ids, "meta_info": meta}


def _render(engine: Engine, res: Finished, opts: dict, params) -> dict:
    opts = {**opts, "routed": res.routed_experts}
    return _payload(engine, res.rid, res.output_ids, res.logprobs, res.top_logprobs, res.finish_reason,
                    res.weight_version, res.prompt_tokens, res.cached_tokens, len(res.output_ids),
                    _text(engine, res.output_ids, res.finish_reason, params), opts, res.e2e_latency_s)


# SGLang GenerateReqInput fields that sglang-router (and SGLang clients) send with every request:
# accepted and ignored, or accepted only when off. Anything else is an unknown key (400).
_GENERATE_IGNORED = {"model", "log_metrics", "no_logs", "extra_key",
                     "custom_labels", "data_parallel_rank"}
_GENERATE_OFF = {"background", "return_hidden_states", "return_bytes", "return_entropy",
                 "lora_path", "image_data", "input_embeds"}
_GENERATE_FIELDS = {"input_ids", "sampling_params", "return_logprob", "rid", "logprob_start_len", "stream",
                    "top_logprobs_num", "return_text_in_logprobs", "return_routed_experts", "priority"}


def _flag(data: dict, name: str) -> bool:
    v = data.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise BadRequest(f"{name} must be true or false, got {v!r}")
    return v


async def generate(request: web.Request) -> web.StreamResponse:
    faults.hit("engine", "generate")
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
    top_n = data.get("top_logprobs_num") or 0
    if isinstance(top_n, bool) or not isinstance(top_n, int) or not 0 <= top_n <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"top_logprobs_num must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top_n!r}")
    opts = {"return_logprob": _flag(data, "return_logprob"), "with_text": _flag(data, "return_text_in_logprobs"),
            "top_n": top_n}
    stream = _flag(data, "stream")
    rid = data.get("rid")
    if rid is None:
        rid = uuid.uuid4().hex
    elif not isinstance(rid, str) or not rid:
        raise BadRequest(f"rid must be a non-empty string, got {rid!r}")
    params = parse_sampling_params(data.get("sampling_params"), engine.vocab_size, engine.max_new_tokens_cap)
    priority = data.get("priority")  # admission order, as SGLang with --enable-priority-scheduling
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)
                                 or not -2**63 <= priority < 2**63):
        raise BadRequest(f"priority must be an integer, got {priority!r}")

    loop = asyncio.get_running_loop()
    done: asyncio.Future[Finished] = loop.create_future()
    step = asyncio.Event()

    def on_done(res: Finished) -> None:  # worker thread -> event loop
        def settle() -> None:
            if not done.done():
                done.set_result(res)
            step.set()
        loop.call_soon_threadsafe(settle)

    on_step = (lambda: loop.call_soon_threadsafe(step.set)) if stream else None
    handle = engine.submit(rid, ids, params, on_done, top_n=top_n if opts["return_logprob"] else 0, on_step=on_step,
                           return_routed_experts=_flag(data, "return_routed_experts"), priority=priority)
    try:
        if not stream:
            res = await done
            return web.json_response(_render(engine, res, opts, params))
        return await _stream(request, engine, handle, done, step, opts, params)
    except (asyncio.CancelledError, ConnectionError):  # the client went away: stop spending compute on it
        engine.abort(rid=rid, message="client disconnected")
        raise


class _IncrementalText:
    """Text of a growing id list without decoding it all again per token (what SGLang's
    detokenizer does with its offsets): ids are folded into a fixed prefix once their text is
    whole (no incomplete UTF-8 character at the end)."""

    def __init__(self, tokenizer, skip_special: bool):
        self.tok, self.skip = tokenizer, skip_special
        self.prefix, self.folded = "", 0

    def __call__(self, ids: list[int]) -> str:
        if len(ids) - self.folded > 32:
            cut = len(ids) - 8
            part = self.tok.decode(ids[self.folded:cut], skip_special_tokens=self.skip)
            if not part.endswith("\ufffd"):
                self.prefix, self.folded = self.prefix + part, cut
        return self.prefix + self.tok.decode(ids[self.folded:], skip_special_tokens=self.skip)


async def _stream(request, engine: Engine, handle, done, step: asyncio.Event, opts: dict, params) -> web.StreamResponse:
    """SSE as SGLang's /generate streams: one ``data:`` object per new token, then ``[DONE]``."""
    incremental = request.app[INCREMENTAL_KEY]
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await out.prepare(request)
    sent, sent_text = 0, 0
    decode = _IncrementalText(engine.tokenizer, params.skip_special_tokens)

    async def send(obj: dict) -> None:
        await out.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")

    while True:
        await step.wait()
        step.clear()
        if done.done():
            break
        n = len(handle.output)
        if n == sent:
            continue
        ids = handle.output[:n]
        text = decode(ids).rstrip("\ufffd")  # an incomplete UTF-8 character waits for its next token
        lo = sent if incremental else 0
        await send(_payload(engine, handle.rid, ids[lo:], handle.logprobs[lo:n], handle.top_logprobs[lo:n], None,
                            handle.weight_version or engine.weight_version, len(handle.input_ids),
                            handle.cached_tokens, n, text[sent_text:] if incremental else text, opts))
        sent, sent_text = n, len(text)
    res = done.result()
    text = _text(engine, res.output_ids, res.finish_reason, params)
    lo = sent if incremental else 0
    await send(_payload(engine, res.rid, res.output_ids[lo:], res.logprobs[lo:], res.top_logprobs[lo:],
                        res.finish_reason, res.weight_version, res.prompt_tokens, res.cached_tokens,
                        len(res.output_ids), text[sent_text:] if incremental else text,
                        {**opts, "routed": res.routed_experts}, res.e2e_latency_s))
    await out.write(b"data: [DONE]\n\n")
    await out.write_eof()
    return out


async def abort_request(request: web.Request) -> web.Response:
    data = await _body(request, {"rid", "abort_all"})
    rid, abort_all = data.get("rid"), data.get("abort_all", False)
    if not isinstance(abort_all, bool):
        raise BadRequest(f"abort_all must be true or false, got {abort_all!r}")
    if rid is not None and not isinstance(rid, str):
        raise BadRequest(f"rid must be a string, got {rid!r}")
    if rid is None and not abort_all:
        raise BadRequest("give rid or abort_all: true")
    request.app[ENGINE_KEY].abort(rid=rid, abort_all=abort_all)
    return web.Response(status=200)  # SGLang answers an empty 200


async def release_memory(request: web.Request) -> web.Response:
    tags = _tags(await _body(request, {"tags"}))
    faults.hit("engine", "release")
    await asyncio.to_thread(request.app[ENGINE_KEY].release, tags)
    return web.json_response(None)  # SGLang's handler returns nothing: FastAPI sends null


async def resume_memory(request: web.Request) -> web.Response:
    tags = _tags(await _body(request, {"tags"}))
    await asyncio.to_thread(request.app[ENGINE_KEY].resume, tags)
    return web.json_response(None)


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
    faults.hit("engine", "weight_load")
    try:
        waited = await asyncio.to_thread(engine.update_weights_from_disk, path, version, abort_all)
    except Refused as e:  # SGLang answers {success: false, message, num_paused_requests} with 400
        return web.json_response({"success": False, "message": e.message, "num_paused_requests": 0}, status=e.status)
    message = "Succeeded to update model weights."
    if version is not None:
        message += f" Weight version updated to {version}."
    return web.json_response({"success": True, "message": message, "num_paused_requests": waited})


async def flush_cache(request: web.Request) -> web.Response:
    await _body(request, set())
    status = 200
    try:
        request.app[ENGINE_KEY].flush_cache()
    except Refused:
        status = 400
    return web.Response(status=status, text="Cache flushed.\nPlease check backend logs for more details. "
                        "(When there are running or waiting requests, the operation will not be performed.)\n")


async def health(request: web.Request) -> web.Response:
    return web.Response(status=503 if request.app[ENGINE_KEY].stopping else 200)  # SGLang: empty body


async def get_weight_version(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": request.app[ENGINE_KEY].weight_version})


async def get_model_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return web.json_response({
        "model_path": str(engine.model_dir), "tokenizer_path": str(engine.model_dir),
        "is_generation": True, "preferred_sampling_params": None, "weight_version": engine.weight_version})


async def get_server_info(request: web.Request) -> web.Response:
    """The subset of SGLang's server args + scheduler info that describes this engine."""
    engine = request.app[ENGINE_KEY]
    return web.json_response({
        "model_path": str(engine.model_dir), "tokenizer_path": str(engine.model_dir),
        "context_length": engine.max_context, "max_running_requests": engine.max_running,
        "incremental_streaming_output": request.app[INCREMENTAL_KEY], "weight_version": engine.weight_version,
        "max_req_input_len": engine.max_context - 1, "version": "gyre-embedded"})


def make_app(engine: Engine, api_key: str | None = None, max_body_bytes: int = 8 << 20,
             incremental_streaming_output: bool = False) -> web.Application:
    app = web.Application(middlewares=[_errors, _auth(api_key)], client_max_size=max_body_bytes)
    app[ENGINE_KEY] = engine
    app[LIMIT_KEY] = max_body_bytes
    app[INCREMENTAL_KEY] = incremental_streaming_output
    app.router.add_post("/generate", generate)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_post("/release_memory_occupation", release_memory)
    app.router.add_post("/resume_memory_occupation", resume_memory)
    app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
    app.router.add_post("/flush_cache", flush_cache)
    # /get_server_info, /server_info and /model_info: what sglang-router asks when a worker joins.
    for path, handler in (("/health", health), ("/health_generate", health), ("/flush_cache", flush_cache),
                          ("/get_weight_version", get_weight_version),
                          ("/get_model_info", get_model_info), ("/model_info", get_model_info),
                          ("/get_server_info", get_server_info), ("/server_info", get_server_info)):
        app.router.add_get(path, handler)
    return app


class EngineServer:
    """The HTTP server for an :class:`Engine`, started inside a running event loop."""

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                 max_body_bytes: int = 8 << 20, incremental_streaming_output: bool = False):
        self.engine, self.host, self.port = engine, host, port
        # handler_cancellation: a client that disconnects aborts its request (like SGLang).
        self._runner = web.AppRunner(make_app(engine, api_key, max_body_bytes, incremental_streaming_output),
                                     access_log=None, handler_cancellation=True)
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


async def serve(engine: Engine, host: str, port: int, api_key: str | None, max_body_bytes: int,
                incremental_streaming_output: bool = False) -> None:
    """Serve until cancelled (SIGINT/SIGTERM); print the ready marker once listening."""
    server = EngineServer(engine, host, port, api_key, max_body_bytes, incremental_streaming_output)
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
