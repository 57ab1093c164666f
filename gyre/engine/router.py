"""In-process router that spreads generation calls over the active rollout endpoints.

It speaks each engine's wire through the client class of its backend (``engine.backend``, from
the table in :mod:`gyre.engine.backends`): SGLang's ``/generate`` for the embedded engine and
SGLang, vLLM's ``/inference/v1/generate`` for vLLM.

* **Affinity.** Rendezvous hashing on an affinity key (the execution id): every call of one
  execution goes to the same endpoint while that endpoint is active, so its prefix (radix)
  cache is reused; different keys spread evenly; adding or removing an endpoint only moves
  the keys that hashed to it.
* **Elastic endpoints.** :meth:`Router.add_endpoint` / :meth:`Router.remove_endpoint` at run time.
  Removing an endpoint aborts the router's requests running there; each of those requests is
  then sent again, from scratch, to another endpoint (its partial output is discarded: nothing
  was recorded yet), so the caller never sees the abort. A request is never lost: it ends with
  a result or a :class:`RouterError`.
* **Failures.** A connection failure, or a 503 (the endpoint released its memory for a role
  switch), moves the request to another endpoint; other 4xx/5xx are the request's own fault and
  are raised at once. Attempts are bounded; with no endpoint left the error says so, and what
  failed where.
* **Aborts.** A generation that ends in ``abort`` the caller did not ask for (endpoint removed,
  ``abort_all``, a weight update with ``abort_all_requests``, an engine error) is sent again; only
  :meth:`Router.abort` (the caller's own abort) comes back as ``finish_reason == "abort"``. A
  caller that is cancelled (its client went away) aborts its engine request by rid.
* **Streaming.** :meth:`Router.generate_stream` passes the engine's chunks through as they
  come. A stream that breaks (endpoint removed or dead, unasked abort) before any token was
  passed on restarts elsewhere; after that it *continues* elsewhere from the prompt plus the
  tokens already passed on (``max_new_tokens`` reduced by as many), since those tokens already
  reached the caller. Such a result's ``weight_version`` is the oldest that served any of it.
* **Load.** :meth:`Router.in_flight` counts the router's running requests per endpoint (what
  a cell agent or the scheduler reads; SGLang's ``/health`` carries no load).

Why not sglang-router (0.3.2 from PyPI, evaluated with ``python benchmarks/studies/eval_sglang_router.py``:
two embedded engines, ``--policy manual`` with the ``x-smg-routing-key`` header, n sequential
1-token ``/generate`` calls alternating direct and routed, on a shared 2-core machine)::

    run (n=1000, 2026-11-29)   direct p50/p99      via sglang-router   added p50/p99
    1                          0.879 / 4.04 ms     1.084 / 4.11 ms     +0.205 / +0.07 ms
    2                          0.843 / 2.92 ms     1.044 / 4.09 ms     +0.201 / +1.18 ms
    (a first run with n=400: +0.203 / +0.34 ms; p99 is noisy on this shared machine.)
    This router over the same worker, run 2: 0.851 / 5.04 ms (p50 +0.008 ms over direct).

Its hop is cheap and it does route with affinity and accept ``POST /workers`` /
``DELETE /workers/{id}`` at run time, but it is unfit for Gyre's elastic scheme:
(1) a request aborted on a worker that is being removed comes back to the caller as
``finish_reason: abort`` (measured: the worker was deleted from the router, then the request
aborted; 200 with ``abort`` and the partial tokens); the router does not retry it elsewhere,
and it cannot tell a role-switch abort from a user abort, so Gyre would need this retry logic
anyway; (2) the response does not say which worker served it (only ``x-request-id``), and the
trajectory record needs the cell that served each call; (3) it is one more process and HTTP
hop on the proxy's latency budget; (4) it rewrites the request body (adds ``model``,
``log_metrics``, ``return_entropy``... which the engine must then accept). The in-process router
has none of these costs. The embedded engine still answers sglang-router's worker probes
(``/server_info``, ``/model_info``) and accepts the fields it adds, so it can sit behind one.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

import aiohttp

from gyre.engine import backends
from gyre.engine.client import EngineClient, EngineError, EngineUnreachable, GenerateResult


class RouterError(RuntimeError):
    """No endpoint could serve the request (none left, or attempts exhausted)."""


@dataclass(eq=False)
class _InFlight:
    rid: str
    endpoint: str
    evicted: bool = False  # its endpoint was removed while it ran: retry elsewhere
    user_aborted: bool = False


def _version_order(v: str):
    """Weight versions are numbers as text ("3" < "10"); anything else sorts after them."""
    try:
        return (0, int(v), "")
    except ValueError:
        return (1, 0, v)


def _score(key: str, endpoint: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\0{endpoint}".encode(), digest_size=8).digest(), "big")


class Router:
    """Use from one event loop (the methods are not thread-safe)."""

    def __init__(self, endpoints: list[str], api_key: str | None = None, timeout_s: float = 600.0,
                 max_attempts: int = 5, connect_retries: int = 1, wait_for_endpoint_s: float = 0.0,
                 session: aiohttp.ClientSession | None = None, backend: str | None = None):
        """``backend``: the ``engine.backend`` the endpoints run; its module's client speaks their
        wire (None: SGLang's ``/generate``, which the embedded engine also serves)."""
        self.api_key, self.timeout_s = api_key, timeout_s
        self._client_class = backends.get(backend).client_class if backend else EngineClient
        self.max_attempts, self.connect_retries = max_attempts, connect_retries
        self.wait_for_endpoint_s = wait_for_endpoint_s
        self._session, self._own_session = session, session is None
        self._endpoints: list[str] = []
        self._clients: dict[str, EngineClient] = {}
        self._inflight: set[_InFlight] = set()
        self._changed: asyncio.Condition | None = None
        self._background: set[asyncio.Task] = set()
        for url in endpoints:
            self.add_endpoint(url)

    # ---- endpoints ---------------------------------------------------------------------------

    def endpoints(self) -> list[str]:
        return list(self._endpoints)

    def in_flight(self) -> dict[str, int]:
        """Requests this router has running, per endpoint URL (removed endpoints included while
        requests still run there; an endpoint with none is absent)."""
        counts: dict[str, int] = {}
        for f in self._inflight:
            counts[f.endpoint] = counts.get(f.endpoint, 0) + 1
        return counts

    def add_endpoint(self, url: str) -> None:
        url = url.rstrip("/")
        if url not in self._endpoints:
            self._endpoints.append(url)
            self._notify()

    async def remove_endpoint(self, url: str, abort: bool = True) -> int:
        """Stop routing to ``url``; with ``abort``, abort the router's requests running there
        (they are retried on other endpoints). Returns how many were aborted."""
        url = url.rstrip("/")
        if url in self._endpoints:
            self._endpoints.remove(url)
        if not abort:
            return 0
        victims = [f for f in self._inflight if f.endpoint == url]
        for f in victims:
            f.evicted = True
        client = self._clients.get(url)
        if client is not None and victims:
            await asyncio.gather(*(client.abort(rid=f.rid) for f in victims), return_exceptions=True)
        return len(victims)

    def pick(self, affinity_key: str, exclude: set[str] | frozenset = frozenset()) -> str | None:
        """The endpoint for ``affinity_key`` (rendezvous hashing), or None if none is left."""
        candidates = [u for u in self._endpoints if u not in exclude]
        return max(candidates, key=lambda u: _score(affinity_key, u)) if candidates else None

    # ---- requests ----------------------------------------------------------------------------

    async def generate(self, affinity_key: str, input_ids: list[int], sampling_params: dict,
                       rid: str | None = None, top_logprobs_num: int = 0, priority: int | None = None,
                       return_routed_experts: bool = False) -> GenerateResult:
        """Generate on the key's endpoint; ``result.endpoint`` says which one served it.
        Raises :class:`RouterError` when no endpoint could, :class:`EngineError` for a bad request."""
        rid = rid or uuid.uuid4().hex
        failed: set[str] = set()
        history: list[str] = []
        for _ in range(self.max_attempts):
            url = await self._pick_or_wait(affinity_key, failed)
            if url is None:
                raise RouterError(f"request {rid}: no endpoint left (active: {self._endpoints or 'none'}; "
                                  f"tried: {'; '.join(history) or 'nothing'})")
            flight = _InFlight(rid, url)
            self._inflight.add(flight)
            try:
                result = await self._client(url).generate(input_ids, sampling_params, rid=rid,
                                                          top_logprobs_num=top_logprobs_num, priority=priority,
                                                          return_routed_experts=return_routed_experts)
            except EngineUnreachable as e:
                failed.add(url)
                history.append(f"{url}: unreachable ({e.message})")
                continue
            except EngineError as e:
                if e.status != 503:
                    raise
                failed.add(url)
                history.append(f"{url}: 503 {e.message}")
                continue
            except asyncio.CancelledError:
                self._abort_behind(url, rid)
                raise
            finally:
                self._inflight.discard(flight)
            if result.finish_reason == "abort" and not flight.user_aborted:
                if flight.evicted:
                    failed.add(url)
                history.append(f"{url}: aborted ({'endpoint removed' if flight.evicted else result.finish_message})")
                continue
            return result
        raise RouterError(f"request {rid}: gave up after {self.max_attempts} attempts: {'; '.join(history)}")

    async def generate_stream(self, affinity_key: str, input_ids: list[int], sampling_params: dict,
                              rid: str | None = None, top_logprobs_num: int = 0,
                              priority: int | None = None,
                              return_routed_experts: bool = False) -> AsyncIterator[GenerateResult]:
        """Cumulative snapshots as tokens come (see the module docstring); the last one has
        ``finish_reason`` set. Same errors as :meth:`generate`."""
        rid = rid or uuid.uuid4().hex
        failed: set[str] = set()
        history: list[str] = []
        done_ids: list[int] = []  # tokens already passed on, from earlier attempts
        done_lps: list[float] = []
        done_tops: list = []
        versions: list[str] = []
        budget = sampling_params.get("max_new_tokens")
        for attempt in range(self.max_attempts):
            url = await self._pick_or_wait(affinity_key, failed)
            if url is None:
                raise RouterError(f"request {rid}: no endpoint left (active: {self._endpoints or 'none'}; "
                                  f"tried: {'; '.join(history) or 'nothing'})")
            params = dict(sampling_params)
            if done_ids and budget is not None:
                params["max_new_tokens"] = budget - len(done_ids)
            # each attempt gets its own rid: the engine may still hold the old one for a moment
            sub_rid = rid if attempt == 0 else f"{rid}-r{attempt}"
            flight = _InFlight(sub_rid, url)
            self._inflight.add(flight)
            passed = 0
            last: GenerateResult | None = None
            ids = input_ids if not done_ids else list(input_ids) + done_ids
            # a continuation's routing covers the whole path again (its input holds done_ids)
            agen = self._client(url).generate_stream(ids, params, rid=sub_rid, top_logprobs_num=top_logprobs_num,
                                                     priority=priority,
                                                     return_routed_experts=return_routed_experts)
            try:
                async for snap in agen:
                    last = snap
                    if snap.finish_reason == "abort" and not flight.user_aborted:
                        break  # not the caller's abort: go on elsewhere
                    if len(snap.output_ids) > passed or snap.finish_reason is not None:
                        passed = len(snap.output_ids)
                        yield self._joined(snap, done_ids, done_lps, done_tops, versions, rid)
            except EngineUnreachable as e:
                failed.add(url)
                history.append(f"{url}: stream broke ({e.message})")
            except EngineError as e:
                if e.status != 503:
                    raise
                failed.add(url)
                history.append(f"{url}: 503 {e.message}")
            except (asyncio.CancelledError, GeneratorExit):
                if last is None or last.finish_reason is None:  # the caller left mid-generation
                    self._abort_behind(url, sub_rid)
                raise
            finally:
                self._inflight.discard(flight)
                await agen.aclose()  # closes the engine connection now, not at garbage collection
            if last is not None and last.finish_reason is not None and last.finish_reason != "abort":
                return
            if last is not None and last.finish_reason == "abort" and flight.user_aborted:
                return
            if last is not None:
                if last.finish_reason == "abort":
                    if flight.evicted:
                        failed.add(url)
                    history.append(f"{url}: aborted ({'endpoint removed' if flight.evicted else last.finish_message})")
                # keep what was passed on; the next attempt continues after it
                done_ids += last.output_ids[:passed]
                done_lps += last.logprobs[:passed]
                done_tops += last.top_logprobs[:passed]
                if passed:
                    versions.append(last.weight_version)
        raise RouterError(f"request {rid}: gave up after {self.max_attempts} attempts: {'; '.join(history)}")

    @staticmethod
    def _joined(snap: GenerateResult, ids, lps, tops, versions: list[str], rid: str) -> GenerateResult:
        if not ids:
            return snap
        snap.output_ids = ids + snap.output_ids
        snap.logprobs = lps + snap.logprobs
        snap.top_logprobs = tops + snap.top_logprobs
        snap.rid = rid
        snap.weight_version = min(versions + [snap.weight_version], key=_version_order)
        return snap

    def _abort_behind(self, url: str, rid: str) -> None:
        """The caller went away: abort its engine request (by rid) without waiting for the answer."""
        task = asyncio.get_running_loop().create_task(self._client(url).abort(rid=rid))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def abort(self, rid: str) -> int:
        """Abort a request wherever it runs; the caller gets ``finish_reason == 'abort'``."""
        flights = [f for f in self._inflight if f.rid == rid]
        for f in flights:
            f.user_aborted = True
        await asyncio.gather(*(self._client(f.endpoint).abort(rid=rid) for f in flights), return_exceptions=True)
        return len(flights)

    async def server_info(self) -> dict:
        """``/get_server_info`` of the first endpoint that answers (limits are the same on all)."""
        errors = []
        for url in list(self._endpoints):
            try:
                return await self._client(url).server_info()
            except EngineError as e:
                errors.append(str(e))
        raise RouterError(f"no endpoint answered /get_server_info: {'; '.join(errors) or 'none active'}")

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
        self._session = None
        self._clients.clear()

    async def __aenter__(self) -> "Router":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ---- internals ---------------------------------------------------------------------------

    def _client(self, url: str) -> EngineClient:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
            self._own_session = True
            self._clients.clear()
        client = self._clients.get(url)
        if client is None:
            client = self._client_class(url, self.api_key, self.timeout_s, self.connect_retries, session=self._session)
            self._clients[url] = client
        return client

    def _notify(self) -> None:
        cond = self._changed
        if cond is not None:
            async def wake() -> None:
                async with cond:
                    cond.notify_all()
            try:
                asyncio.get_running_loop().create_task(wake())
            except RuntimeError:  # no loop running (endpoints added before start): nobody waits
                pass

    async def _pick_or_wait(self, key: str, failed: set[str]) -> str | None:
        url = self.pick(key, failed)
        if url is not None or self.wait_for_endpoint_s <= 0:
            return url
        if self._changed is None:
            self._changed = asyncio.Condition()
        try:
            async with self._changed:
                await asyncio.wait_for(self._changed.wait_for(lambda: self.pick(key, failed) is not None),
                                       self.wait_for_endpoint_s)
        except asyncio.TimeoutError:
            return None
        return self.pick(key, failed)
