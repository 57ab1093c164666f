"""vLLM's token-in/token-out generate wire, as the router's client: Gyre's calls (SGLang's names)
in, :class:`~gyre.engine.client.GenerateResult` out.

Route: ``POST /inference/v1/generate`` (vLLM 0.32, ``vllm/entrypoints/scale_out/token_in_token_out/
api_router.py``; the server needs ``--enable-scale-out``), body ``GenerateRequest``
(``protocol.py`` there): ``request_id``, ``token_ids``, ``sampling_params`` (vLLM's
``SamplingParams``), ``stream``. The answer's choice carries ``token_ids``, ``logprobs.content``
(``token_id``, ``logprob`` per output token), ``finish_reason`` (stop | length | abort) and
``weight_versions`` (spans of output tokens per weight version; in the last chunk of a stream).
A stream sends each new token as a delta (``data: {...}``), then ``data: [DONE]``.

Sampling parameters: ``max_new_tokens`` -> ``max_tokens``, ``sampling_seed`` -> ``seed``;
``temperature``, ``stop_token_ids``, ``ignore_eos``, ``stop`` keep their names. Refused (400, the
reason in the message): ``top_p`` < 1, ``top_k`` >= 1 and ``min_p`` > 0, because vLLM's processed
log-probs (``--logprobs-mode processed_logprobs``) are renormalised over the kept tokens while
the trainer computes ``log_softmax(logits / T)`` over the whole vocabulary (gyre/engine/sampling.py).
The proxy's per-call ``priority`` is not sent (vLLM's priority scheduling orders the other way and
must be enabled at start); ``return_routed_experts`` is refused at config time
(train.routing_replay).

Request ids: vLLM prefixes the given id with ``generate-tokens-`` (``serving.py``: ``request_id =
f"generate-tokens-{...}"``); aborts name that id at ``POST /inference/v1/abort_requests``.
"""

from __future__ import annotations

import json
from typing import AsyncIterator

import aiohttp

from gyre.engine.client import (_CONNECTION_ERRORS, EngineClient, EngineError, EngineUnreachable, GenerateResult,
                               error_message)

GENERATE = "/inference/v1/generate"
ABORT = "/inference/v1/abort_requests"
RID_PREFIX = "generate-tokens-"
PASSED = {"temperature": "temperature", "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos",
          "stop": "stop", "max_new_tokens": "max_tokens", "sampling_seed": "seed"}
IGNORED = {"skip_special_tokens", "no_stop_trim"}  # text-only: Gyre reads token ids


def sampling_params(params: dict) -> dict:
    """vLLM's ``SamplingParams`` for Gyre's (SGLang-named) ones; raises ``ValueError`` for a
    parameter vLLM cannot honour with the log-probs the trainer needs."""
    if (params.get("top_p") if params.get("top_p") is not None else 1.0) < 1.0:
        raise ValueError(f"top_p={params['top_p']} is refused on the vLLM backend: its log-probs would be "
                         "renormalised over the top-p set, not the trainer's log_softmax(logits / T); send top_p = 1")
    if (params.get("top_k") or -1) >= 1:
        raise ValueError(f"top_k={params['top_k']} is refused on the vLLM backend (same reason as top_p); send -1")
    if (params.get("min_p") or 0.0) > 0:
        raise ValueError(f"min_p={params['min_p']} is refused on the vLLM backend (same reason as top_p); send 0")
    unknown = set(params) - set(PASSED) - IGNORED - {"top_p", "top_k", "min_p"}
    if unknown:
        raise ValueError(f"sampling parameter(s) {sorted(unknown)} are not supported on the vLLM backend")
    out = {PASSED[k]: v for k, v in params.items() if k in PASSED and v is not None}
    out.setdefault("max_tokens", 128)  # SGLang's default max_new_tokens
    out["logprobs"] = 0  # the sampled token's log-prob
    return out


def _tokens(choice: dict) -> tuple[list[int], list[float]]:
    ids = [int(t) for t in choice.get("token_ids") or []]
    content = (choice.get("logprobs") or {}).get("content") or []
    return ids, [float(c["logprob"]) for c in content]


def _result(choice: dict, ids, lps, endpoint: str, rid: str, prompt_tokens: int, usage: dict | None) -> GenerateResult:
    spans = choice.get("weight_versions") or []
    reason = choice.get("finish_reason")
    details = (usage or {}).get("prompt_tokens_details") or {}
    meta = {"weight_versions": spans, "stop_reason": choice.get("stop_reason"), "completion_tokens": len(ids)}
    return GenerateResult(
        output_ids=list(ids), logprobs=list(lps), finish_reason=reason,
        weight_version=str(spans[0]["version"]) if spans else "", endpoint=endpoint, rid=rid,
        prompt_tokens=(usage or {}).get("prompt_tokens", prompt_tokens), cached_tokens=details.get("cached_tokens") or 0,
        meta_info=meta, finish_message="" if reason != "abort" else "aborted by the engine")


class VLLMClient(EngineClient):
    """:class:`EngineClient` over vLLM's generate wire (same constructor, same results)."""

    def _body(self, input_ids, params: dict, rid: str | None, top_logprobs_num: int, stream: bool,
              return_routed_experts: bool) -> dict:
        if return_routed_experts:
            raise EngineError(400, "return_routed_experts: the vLLM backend does not return routed experts "
                                   "(train.routing_replay needs engine.backend sglang or embedded)", self.base_url)
        if top_logprobs_num:
            raise EngineError(400, "top_logprobs: not supported on the vLLM backend", self.base_url)
        try:
            sp = sampling_params(params)
        except ValueError as e:
            raise EngineError(400, str(e), self.base_url) from None
        body = {"token_ids": list(input_ids), "sampling_params": sp, "stream": stream}
        if rid is not None:
            body["request_id"] = rid
        return body

    async def generate(self, input_ids, sampling_params: dict, rid: str | None = None, top_logprobs_num: int = 0,
                       priority: int | None = None, return_routed_experts: bool = False) -> GenerateResult:
        timing: list[float] = []
        data = await self._request("POST", GENERATE, self._body(input_ids, sampling_params, rid, top_logprobs_num,
                                                                 False, return_routed_experts), timing=timing)
        choice = (data.get("choices") or [{}])[0]
        ids, lps = _tokens(choice)
        res = _result(choice, ids, lps, self.base_url, rid or "", len(input_ids), data.get("usage"))
        res.wire_s = timing[-1] if timing else 0.0
        return res

    async def generate_stream(self, input_ids, sampling_params: dict, rid: str | None = None,
                              top_logprobs_num: int = 0, priority: int | None = None,
                              return_routed_experts: bool = False) -> AsyncIterator[GenerateResult]:
        """Cumulative snapshots (vLLM streams deltas); the last has ``finish_reason`` set."""
        body = self._body(input_ids, sampling_params, rid, top_logprobs_num, True, return_routed_experts)
        resp = await self._open_stream(GENERATE, json.dumps(body).encode())
        ids: list[int] = []
        lps: list[float] = []
        async with resp:
            await self._raise_for_stream_status(resp)
            buf = b""
            try:
                async for piece in resp.content.iter_any():
                    buf += piece
                    *events, buf = buf.split(b"\n\n")
                    last, done = None, False
                    for event in events:
                        if not event.startswith(b"data: "):
                            continue
                        payload = event[6:].strip()
                        if payload == b"[DONE]":
                            done = True
                            break
                        data = json.loads(payload)
                        if "error" in data:
                            raise EngineError(400, error_message(data, "error in stream"), self.base_url)
                        choice = (data.get("choices") or [{}])[0]
                        new_ids, new_lps = _tokens(choice)
                        ids += new_ids
                        lps += new_lps
                        last = (choice, data.get("usage"))
                    if last is not None:
                        # one snapshot per read: deltas that arrived together (a reader behind the
                        # server, by hundreds of tokens under load) make one snapshot, not one each,
                        # since each snapshot copies every token so far (quadratic in the length)
                        yield _result(last[0], ids, lps, self.base_url, rid or "", len(input_ids), last[1])
                    if done:
                        return
            except _CONNECTION_ERRORS + (aiohttp.ClientPayloadError,) as e:
                raise EngineUnreachable(f"stream from POST {GENERATE} broke after {len(ids)} tokens: "
                                        f"{type(e).__name__}: {e}", self.base_url) from None
        raise EngineUnreachable(f"stream from POST {GENERATE} ended without [DONE] after {len(ids)} tokens",
                                self.base_url)

    async def abort(self, rid: str | None = None, abort_all: bool = False) -> dict:
        """Abort ``rid`` (vLLM's abort route takes ids; ``abort_all`` uses the RL ``/abort_requests``
        with no ids, which aborts everything running)."""
        if abort_all:
            return await self._request("POST", "/abort_requests", {})
        return await self._request("POST", ABORT, {"request_ids": [RID_PREFIX + str(rid)]})

    async def weight_version(self) -> str:
        return str((await self._request("GET", "/weight_info"))["weight_version"])

    async def flush_cache(self) -> dict:
        return await self._request("POST", "/reset_prefix_cache", {})
