"""Async client for SGLang's RL HTTP subset; the same code talks to SGLang and the embedded engine.

Retries only when the connection fails (refused, reset, closed before a response): a 4xx/5xx
answer is the engine's decision and is raised as :class:`EngineError` at once.

:meth:`EngineClient.generate_stream` reads SGLang's streamed ``/generate`` (``data: {...}`` events,
then ``data: [DONE]``), cumulative by default or incremental (``--incremental-streaming-output``):
the two are told apart by ``meta_info.completion_tokens`` (always the running total), and either
way the caller gets cumulative :class:`GenerateResult` snapshots.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import aiohttp


class EngineError(Exception):
    """An engine answered with an error status, or could not be reached (``status`` None)."""

    def __init__(self, status: int | None, message: str, endpoint: str):
        super().__init__(f"{endpoint}: {status or 'unreachable'}: {message}")
        self.status, self.message, self.endpoint = status, message, endpoint


class EngineUnreachable(EngineError):
    """Connecting (or keeping the connection) failed after all retries."""

    def __init__(self, message: str, endpoint: str):
        super().__init__(None, message, endpoint)


@dataclass
class GenerateResult:
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None  # stop | length | abort; None in a streamed snapshot before the end
    weight_version: str
    endpoint: str
    text: str = ""
    rid: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    meta_info: dict = field(default_factory=dict, repr=False)
    # per output position: the most probable (logprob, token_id) pairs (when asked for)
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list, repr=False)
    finish_message: str = ""
    wire_s: float = 0.0  # seconds from sending the encoded request to having the whole answer


def _result(data: dict, endpoint: str, rid: str | None) -> GenerateResult:
    meta = data.get("meta_info", {})
    triples = meta.get("output_token_logprobs") or []
    reason = meta.get("finish_reason") or {}
    return GenerateResult(
        output_ids=list(data.get("output_ids", [])), logprobs=[float(t[0]) for t in triples],
        finish_reason=reason.get("type", "unknown") if reason else None,
        weight_version=str(meta.get("weight_version", "")), endpoint=endpoint,
        text=data.get("text") or "", rid=meta.get("id", rid or ""), prompt_tokens=meta.get("prompt_tokens", 0),
        cached_tokens=meta.get("cached_tokens", 0), meta_info=meta,
        top_logprobs=[[(float(x[0]), int(x[1])) for x in pos] for pos in meta.get("output_top_logprobs") or []],
        finish_message=str(reason.get("message", "")) if reason else "")


_CONNECTION_ERRORS = (aiohttp.ClientConnectionError, ConnectionError)


class EngineClient:
    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 600.0,
                 connect_retries: int = 3, session: aiohttp.ClientSession | None = None,
                 retry_backoff_s: float = 0.2):
        self.base_url = base_url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.connect_retries = connect_retries
        self.retry_backoff_s = retry_backoff_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session = session
        self._own_session = session is None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No connection cap: the proxy may hold hundreds of concurrent generations.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
            self._own_session = True
        return self._session

    async def _request(self, method: str, path: str, body: dict | None = None, retries: int | None = None,
                       timing: list | None = None) -> dict:
        url = self.base_url + path
        retries = self.connect_retries if retries is None else retries
        last: Exception | None = None
        data_bytes = encode_body(body) if body is not None else None
        headers = {**self._headers, "Content-Type": "application/json"} if body is not None else self._headers
        for attempt in range(retries + 1):
            if attempt:
                await asyncio.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
            try:
                t0 = time.perf_counter()
                async with self._get_session().request(method, url, data=data_bytes, headers=headers,
                                                       timeout=self.timeout) as resp:
                    raw = await resp.read()
                    if timing is not None:
                        timing.append(time.perf_counter() - t0)
                    try:
                        data = await resp.json(content_type=None) if raw else {}
                    except ValueError:
                        data = {"error": {"message": raw[:500].decode("utf-8", "replace")}}
                    if resp.status >= 400:
                        raise EngineError(resp.status, error_message(data, resp.reason), self.base_url)
                    return data if isinstance(data, dict) else {"value": data}
            except asyncio.TimeoutError:  # before connection errors: aiohttp's timeouts are both
                raise EngineError(None, f"{method} {path} timed out after {self.timeout.total} s",
                                  self.base_url) from None
            except _CONNECTION_ERRORS as e:
                last = e
        raise EngineUnreachable(f"{method} {path} failed after {retries + 1} attempt(s): "
                                f"{type(last).__name__}: {last}", self.base_url)

    def _generate_body(self, input_ids, sampling_params, rid, top_logprobs_num, stream, priority=None,
                       return_routed_experts: bool = False) -> dict:
        ids = input_ids if getattr(input_ids, "json_text", None) else list(input_ids)
        body = {"input_ids": ids, "sampling_params": sampling_params, "return_logprob": True}
        if return_routed_experts:  # MoE routing replay: meta_info.routed_experts in the final answer
            body["return_routed_experts"] = True
        if rid is not None:
            body["rid"] = rid
        if top_logprobs_num:
            body["top_logprobs_num"] = top_logprobs_num
        if stream:
            body["stream"] = True
        if priority is not None:  # SGLang's GenerateReqInput.priority (higher first with --enable-priority-scheduling)
            body["priority"] = priority
        return body

    async def generate(self, input_ids: list[int], sampling_params: dict, rid: str | None = None,
                       top_logprobs_num: int = 0, priority: int | None = None,
                       return_routed_experts: bool = False) -> GenerateResult:
        timing: list[float] = []
        data = await self._request("POST", "/generate",
                                   self._generate_body(input_ids, sampling_params, rid, top_logprobs_num, False,
                                                       priority, return_routed_experts),
                                   timing=timing)
        res = _result(data, self.base_url, rid)
        res.wire_s = timing[-1] if timing else 0.0
        return res

    async def _open_stream(self, path: str, data: bytes) -> aiohttp.ClientResponse:
        """POST a streamed request; connection failures before the first byte are retried with
        backoff (the one retry loop of every backend's stream)."""
        last: Exception | None = None
        for attempt in range(self.connect_retries + 1):
            if attempt:
                await asyncio.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
            try:
                return await self._get_session().post(self.base_url + path, data=data, timeout=self.timeout,
                                                      headers={**self._headers, "Content-Type": "application/json"})
            except asyncio.TimeoutError:
                raise EngineError(None, f"POST {path} timed out after {self.timeout.total} s", self.base_url) from None
            except _CONNECTION_ERRORS as e:
                last = e
        raise EngineUnreachable(f"POST {path} (stream) failed after {self.connect_retries + 1} attempt(s): "
                                f"{type(last).__name__}: {last}", self.base_url)

    async def _raise_for_stream_status(self, resp) -> None:
        """A streamed request the engine refused before streaming: its reason as an EngineError
        (a JSON error body in any engine's shape, else the body's first 500 bytes)."""
        if resp.status < 400:
            return
        raw = await resp.read()
        try:
            data = json.loads(raw) if raw else {}
        except ValueError:
            data = {"error": {"message": raw[:500].decode("utf-8", "replace")}}
        raise EngineError(resp.status, error_message(data, resp.reason), self.base_url)

    async def generate_stream(self, input_ids: list[int], sampling_params: dict, rid: str | None = None,
                              top_logprobs_num: int = 0, priority: int | None = None,
                              return_routed_experts: bool = False) -> AsyncIterator[GenerateResult]:
        """Cumulative snapshots as the engine streams them; the last has ``finish_reason`` set.
        Connection failures before the first byte are retried like :meth:`generate`; a stream
        that breaks later raises :class:`EngineUnreachable` (the caller decides how to go on)."""
        body = self._generate_body(input_ids, sampling_params, rid, top_logprobs_num, True, priority,
                                   return_routed_experts)
        resp = await self._open_stream("/generate", encode_body(body))
        async with resp:
            await self._raise_for_stream_status(resp)
            ids: list[int] = []
            lps: list[float] = []
            tops: list = []
            buf = b""
            cumulative = False  # known once a snapshot of 2+ tokens holds them all (SGLang's default)
            try:
                async for piece in resp.content.iter_any():
                    buf += piece
                    if b"\n\n" not in buf:
                        continue
                    events = buf.split(b"\n\n")
                    buf = events.pop()
                    payloads = [e[6:] for e in events if e.startswith(b"data: ")]
                    done = bool(payloads) and payloads[-1].strip() == b"[DONE]"
                    if done:
                        payloads.pop()
                    if cumulative and len(payloads) > 1:
                        # the last cumulative snapshot holds all the others: when the reader lags
                        # (a busy proxy), parse it alone, not each one (a 4K-token stream would
                        # otherwise parse ~8M ids, quadratic in its length)
                        payloads = payloads[-1:]
                    for payload in payloads:
                        data = json.loads(payload)
                        if "error" in data:  # SGLang reports a failure inside the stream
                            raise EngineError(400, error_message(data, "error in stream"), self.base_url)
                        snap = _result(data, self.base_url, rid)
                        total = snap.meta_info.get("completion_tokens", len(snap.output_ids))
                        if len(snap.output_ids) < total and len(ids) + len(snap.output_ids) == total:
                            ids, lps, tops = ids + snap.output_ids, lps + snap.logprobs, tops + snap.top_logprobs
                        else:  # cumulative (SGLang's default), or the first incremental chunk
                            # a second snapshot that holds every token so far: cumulative for sure
                            cumulative = cumulative or (bool(ids) and len(snap.output_ids) == total > len(ids))
                            ids, lps, tops = snap.output_ids, snap.logprobs, snap.top_logprobs
                        snap.output_ids, snap.logprobs, snap.top_logprobs = list(ids), list(lps), list(tops)
                        yield snap
                    if done:
                        return
            except _CONNECTION_ERRORS + (aiohttp.ClientPayloadError,) as e:
                raise EngineUnreachable(f"stream from POST /generate broke after {len(ids)} tokens: "
                                        f"{type(e).__name__}: {e}", self.base_url) from None
        raise EngineUnreachable(f"stream from POST /generate ended without [DONE] after {len(ids)} tokens",
                                self.base_url)

    async def abort(self, rid: str | None = None, abort_all: bool = False) -> dict:
        body = {"abort_all": True} if abort_all else {"rid": rid}
        return await self._request("POST", "/abort_request", body)

    async def release_memory(self, tags: list[str] | None = None) -> dict:
        return await self._request("POST", "/release_memory_occupation", {"tags": tags})

    async def resume_memory(self, tags: list[str] | None = None) -> dict:
        return await self._request("POST", "/resume_memory_occupation", {"tags": tags})

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> dict:
        return await self._request("POST", "/update_weights_from_disk",
                                   {"model_path": str(model_path), "weight_version": weight_version})

    async def flush_cache(self) -> dict:
        return await self._request("POST", "/flush_cache", {})

    async def health(self) -> bool:
        """True when ``GET /health`` answers 200 (SGLang: an empty body)."""
        try:
            await self._request("GET", "/health", retries=0)  # a health probe must answer fast
            return True
        except EngineError:
            return False

    async def weight_version(self) -> str:
        return str((await self._request("GET", "/get_weight_version"))["weight_version"])

    async def model_info(self) -> dict:
        return await self._request("GET", "/get_model_info")

    async def server_info(self) -> dict:
        """SGLang's ``/get_server_info``: server args and scheduler limits (``max_req_input_len``...)."""
        return await self._request("GET", "/get_server_info")

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
        self._session = None

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def encode_body(body: dict) -> bytes:
    """JSON of a request body; ``input_ids`` that carry their own ``json_text`` (the proxy's
    cached encoding of stored ids) are spliced in instead of being encoded again."""
    ids = body.get("input_ids")
    pre = getattr(ids, "json_text", None)
    if not pre:
        return json.dumps({**body, "input_ids": list(ids)} if ids is not None and not isinstance(ids, list)
                          else body).encode()
    text = json.dumps({**body, "input_ids": 0})
    return text.replace('"input_ids": 0', '"input_ids": [' + pre + "]", 1).encode()


def error_message(data, default: str) -> str:
    """The reason in an engine's error body, whoever wrote it: OpenAI's ``{"error": {"message"}}``,
    SGLang's ``{"error": "..."}`` or ``{"message"}``, FastAPI's ``{"detail"}`` (vLLM); else ``default``."""
    if not isinstance(data, dict):
        return default
    err = data.get("error")
    if isinstance(err, dict) and err.get("message"):
        return str(err["message"])
    if isinstance(err, str):
        return err
    for key in ("detail", "message"):
        if data.get(key):
            return str(data[key])
    return default
