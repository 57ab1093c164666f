"""The embedded engine's scheduler: one worker thread runs every model forward.

Requests are admitted from a queue (up to ``max_running``) and advance together in rounds: each
round runs one prompt chunk of every request still in its prompt (chunked prefill, so a long
prompt does not stall the others), then one batched decode step for all the others. Each
request owns its KV cache; finished caches go to a :class:`PrefixCache`. Aborts are checked
between rounds. The HTTP side never touches the model: it submits requests with a completion
callback and calls the admin methods (release/resume/update/flush), which coordinate with the
worker through one condition variable.

A request ends with ``finish_reason`` ``stop`` (``matched``: the stop token, which IS the last
element of ``output_ids``; or the stop string, completed by the last element of ``output_ids``,
checked as SGLang does on the decoded tail of the output), ``length`` (``max_new_tokens`` reached, or the context is full) or
``abort`` (partial output kept).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from gyre.engine.pace import Pacer
from gyre.engine.prefix_cache import PrefixCache
from gyre.engine.hybrid import causal_lm
from gyre.engine.qwen import CausalLM, KVCache
from gyre.model.families import ModelFormatError
from gyre.model.spec import load_weights, read_spec
from gyre.engine.sampling import SamplingParams, sample
from gyre.model.checksums import WeightCheckError, check_finite, require_regular_files, verify_checksums
from gyre.model.identity import model_identity
from gyre.model.tokenizer import load_tokenizer

MEMORY_TAGS = ("kv_cache", "weights")
RECOMPUTE_IDENTITY_BYTES = 256 << 20


class Refused(Exception):
    """The engine cannot do this now or with these inputs; ``status`` is the HTTP status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Finished:
    rid: str
    prompt_tokens: int
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: dict
    weight_version: str
    cached_tokens: int
    e2e_latency_s: float
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    routed_experts: "torch.Tensor | None" = None  # [prompt + output - 1, moe layers, top_k] when asked


UNSET_PRIORITY = -(2**63)  # SGLang (priority scheduling, higher first) gives a request without one the lowest


@dataclass
class _Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    on_done: Callable[[Finished], None]
    generator: torch.Generator
    created: float = field(default_factory=time.monotonic)
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cache: KVCache | None = None
    fed: int = 0  # prompt tokens already in the cache
    cached_tokens: int = 0
    weight_version: str = ""
    abort_message: str | None = None
    top_n: int = 0  # top log-probs to keep per output position (SGLang's top_logprobs_num)
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    on_step: Callable[[], None] | None = None  # called (worker thread) after each new token
    stop_tail_tokens: int = 0  # how many output tokens to decode when looking for stop strings
    return_routed_experts: bool = False  # SGLang's request flag (MoE models)
    routed: "torch.Tensor | None" = None  # read from the cache when the request finishes
    priority: int = 0  # SGLang's request priority: higher is admitted first, first come first within


class Engine:
    def __init__(self, model_dir: str | os.PathLike, weight_version: str = "0", max_running: int = 64,
                 max_new_tokens_cap: int = 4096, prefill_chunk: int = 512,
                 prefix_cache_mb: int = 256, pace: bool = False):
        self.model_dir = Path(model_dir)
        self._start_dir = self.model_dir.resolve()  # trusted without a manifest (see _trusted)
        spec = read_spec(self.model_dir)
        self.model: CausalLM | None = causal_lm(spec, load_weights(self.model_dir, spec))
        self.spec = self.model.spec
        try:
            self.tokenizer = load_tokenizer(self.model_dir)
        except Exception as e:  # tokenizers raises a plain Exception for a missing/bad file
            raise ModelFormatError(f"{self.model_dir}/tokenizer.json: {e}") from None
        self._tokenizer_hash = hashlib.sha256((self.model_dir / "tokenizer.json").read_bytes()).hexdigest()
        self.weight_version = weight_version
        self.max_running = max_running
        self.max_new_tokens_cap = max_new_tokens_cap
        self.prefill_chunk = prefill_chunk
        self._identity: dict | None = None
        s = self.spec
        kv_bytes_per_token = 2 * len(s.full_layers) * s.kv_heads * s.head_dim * 4  # float32 keys + values
        self._prefix = PrefixCache(max(1, (prefix_cache_mb << 20) // kv_bytes_per_token))
        # engine.pace (benchmarks only): each decode step lasts the paced replica's roofline time
        # for its batch (gyre/engine/pace.py), so this engine behaves like a loaded GPU replica
        self.pacer: Pacer | None = Pacer() if pace else None
        self._cv = threading.Condition()
        self._admin = threading.Lock()  # one release/resume/update at a time
        self._pending: deque[_Request] = deque()
        self._active: list[_Request] = []
        self._paused = False  # True while a weight update waits for the running requests
        self._released: set[str] = set()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="gyre-engine-worker", daemon=True)
        self._thread.start()

    # ---- public API (any thread) ------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def max_context(self) -> int:
        return self.spec.max_positions

    def identity(self) -> dict:
        if self._identity is None:
            # Small checkpoints are hashed from the tensors every time they are loaded, so a
            # stale gyre_identity.json copied along with new weights cannot mislabel them.
            size = sum(f.stat().st_size for f in self.model_dir.glob("*.safetensors"))
            ident = dict(model_identity(self.model_dir, recompute=size < RECOMPUTE_IDENTITY_BYTES))
            # The tokenizer never changes with a weight update (exports may not carry one).
            ident["tokenizer_hash"] = self._tokenizer_hash
            self._identity = ident
        return self._identity

    def load(self) -> dict:
        with self._cv:
            return {"running": len(self._active), "queued": len(self._pending),
                    "prefix_cache_tokens": self._prefix.tokens}

    def submit(self, rid: str, input_ids: list[int], params: SamplingParams,
               on_done: Callable[[Finished], None], top_n: int = 0,
               on_step: Callable[[], None] | None = None, return_routed_experts: bool = False,
               priority: int | None = None) -> "_Request":
        """Queue a request; returns its handle (``output``/``logprobs`` grow as tokens come)."""
        if return_routed_experts and not self.spec.moe_layers:
            raise Refused(400, "return_routed_experts needs a Mixture-of-Experts model; this one is dense")
        if len(input_ids) >= self.max_context:
            # SGLang's wording (TokenizerManager._validate_one_request)
            raise Refused(400, f"The input ({len(input_ids)} tokens) is longer than the model's context "
                               f"length ({self.max_context} tokens).")
        gen = torch.Generator()
        gen.manual_seed(params.sampling_seed if params.sampling_seed is not None
                        else int.from_bytes(os.urandom(8), "little") >> 1)
        req = _Request(rid, input_ids, params, on_done, gen, top_n=top_n, on_step=on_step,
                       return_routed_experts=return_routed_experts,
                       priority=UNSET_PRIORITY if priority is None else priority)
        if params.stop:  # SGLang: decode the last (longest stop string in tokens + 1) tokens
            req.stop_tail_tokens = 1 + max(len(self.tokenizer.encode(s, add_special_tokens=False).ids)
                                           for s in params.stop)
        with self._cv:
            if self._released:
                raise Refused(503, f"memory is released ({', '.join(sorted(self._released))}); "
                                   "POST /resume_memory_occupation first")
            if self._stopping:
                raise Refused(503, "engine is shutting down")
            if any(r.rid == rid for r in self._active) or any(r.rid == rid for r in self._pending):
                raise Refused(400, f"rid {rid!r} is already in use by a running request")
            self._pending.append(req)
            self._cv.notify_all()
        return req

    def abort(self, rid: str | None = None, abort_all: bool = False, message: str = "aborted by request") -> int:
        """Abort one request (by rid) or all; running ones end at their next step. Returns count."""
        dropped = []
        with self._cv:
            for r in list(self._pending):
                if abort_all or r.rid == rid:
                    self._pending.remove(r)
                    r.abort_message = message
                    dropped.append(r)
            n = len(dropped)
            for r in self._active:
                if (abort_all or r.rid == rid) and r.abort_message is None:
                    r.abort_message = message
                    n += 1
            self._cv.notify_all()
        for r in dropped:
            self._finish_unlocked(r, {"type": "abort", "message": message})
        return n

    def release(self, tags: list[str]) -> None:
        with self._admin, self._cv:
            self._refuse_if_busy("release memory")
            if "kv_cache" in tags:
                self._prefix.clear()
            if "weights" in tags:
                self.model = None  # freed, as SGLang frees them; resume reloads from model_dir
            self._released |= set(tags)

    def resume(self, tags: list[str]) -> None:
        with self._admin:
            if "weights" in tags and "weights" in self._released:
                # the files may have changed while released: checked as a weight update is
                model = self._load_model(self.model_dir, verify=True, trusted=self._trusted(self.model_dir))
                with self._cv:
                    self.model = model
            with self._cv:
                self._released -= set(tags)
                self._cv.notify_all()

    def update_weights_from_disk(self, model_path: str, weight_version: str | None,
                                 abort_all: bool = False) -> int:
        """Load new weights; they take effect once running requests finish (queued ones wait).
        Returns how many requests were waited for."""
        with self._admin:
            if "weights" in self._released:
                raise Refused(400, "weights are released; POST /resume_memory_occupation first")
            # while requests still run on the old weights
            model = self._load_model(Path(model_path), verify=True, trusted=self._trusted(Path(model_path)))
            if model.spec.vocab_size != self.spec.vocab_size:
                raise Refused(400, f"{model_path}: vocab_size {model.spec.vocab_size} differs from the "
                                   f"served model's {self.spec.vocab_size}")
            with self._cv:
                self._paused = True
                waited = len(self._active)
                try:
                    if abort_all:
                        for r in self._active:
                            r.abort_message = r.abort_message or "aborted for a weight update"
                    while self._active:
                        self._cv.wait()
                    self.model, self.spec = model, model.spec
                    self.model_dir = Path(model_path)
                    self._identity = None
                    if weight_version is not None:
                        self.weight_version = weight_version
                    self._prefix.clear()  # cached keys/values belong to the old weights
                finally:
                    self._paused = False
                    self._cv.notify_all()
            return waited

    def flush_cache(self) -> None:
        with self._cv:
            self._refuse_if_busy("flush the cache")
            self._prefix.clear()

    def close(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    # ---- internals ---------------------------------------------------------------------------

    def _refuse_if_busy(self, what: str) -> None:
        busy = len(self._active) + len(self._pending)
        if busy:
            raise Refused(400, f"cannot {what} while {busy} request(s) are running or queued; "
                               "abort them (POST /abort_request) or wait")

    def _trusted(self, path: Path) -> bool:
        """The checkpoint the engine was started from may lack a manifest (a plain Hugging Face
        directory); any other must carry one (an export writes it)."""
        return path.resolve() == self._start_dir

    @staticmethod
    def _load_model(path: Path, verify: bool = False, trusted: bool = False) -> CausalLM:
        """Load a checkpoint; with ``verify``, first its checksum manifest (required unless
        ``trusted``) and the finiteness of every tensor, so a corrupt export never replaces good weights."""
        try:
            require_regular_files(path)
            if verify:
                verify_checksums(path, required=not trusted)
            spec = read_spec(path)
            tensors = load_weights(path, spec)
            if verify:
                check_finite(tensors)
            return causal_lm(spec, tensors)
        except WeightCheckError as e:
            raise Refused(400, f"refused weights from {path}: {e}; the previous weights stay loaded") from None
        except (ModelFormatError, OSError) as e:
            raise Refused(400, f"cannot load weights from {path}: {e}") from None
        except Exception as e:  # safetensors raises its own error types on corrupt files
            raise Refused(400, f"cannot load weights from {path}: {type(e).__name__}: {e}") from None

    def _finish_unlocked(self, r: _Request, reason: dict) -> None:
        result = Finished(r.rid, len(r.input_ids), list(r.output), list(r.logprobs), reason,
                          r.weight_version or self.weight_version, r.cached_tokens,
                          time.monotonic() - r.created, list(r.top_logprobs), r.routed)
        try:
            r.on_done(result)
        except Exception:  # a broken callback must not kill the worker
            traceback.print_exc()

    def _finish(self, r: _Request, reason: dict, keep_cache: bool = True) -> None:
        with self._cv:
            self._active.remove(r)
            if r.return_routed_experts and r.cache is not None:
                # every position the model ran: the prompt and all outputs but the last
                r.routed = r.cache.routed_experts(min(r.cache.length, len(r.input_ids) + max(len(r.output) - 1, 0)))
            if keep_cache and r.cache is not None and r.fed == len(r.input_ids):
                covered = r.input_ids + r.output[:-1]
                if r.cache.length == len(covered):
                    self._prefix.insert(covered, r.cache)
            r.cache = None
            self._cv.notify_all()
        self._finish_unlocked(r, reason)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._active and (self._paused or not self._pending):
                    self._cv.wait()
                if self._stopping:
                    doomed = list(self._pending) + self._active
                    self._pending.clear()
                    break
                while self._pending and not self._paused and len(self._active) < self.max_running:
                    # SGLang --enable-priority-scheduling: highest priority first, first come first within
                    r = max(self._pending, key=lambda q: q.priority)
                    self._pending.remove(r)
                    r.weight_version = self.weight_version
                    r.cache, r.fed = self._prefix.lookup(r.input_ids)
                    r.cached_tokens = r.fed
                    if r.cache is None:
                        r.cache = self.model.new_cache()
                    self._active.append(r)
                batch = list(self._active)
                model = self.model
            try:
                self._round(model, batch)
            except Exception as e:  # never let the worker die: fail this round's requests instead
                self._fail([r for r in batch if r in self._active], e)
        for r in doomed:
            self._finish_unlocked(r, {"type": "abort", "message": "engine shut down"})

    def _round(self, model: CausalLM, batch: list[_Request]) -> None:
        """One step for every active request: a prompt chunk each, then one batched decode."""
        if self.pacer is not None:
            self.pacer.start()
        live = []
        for r in batch:
            if r.abort_message is not None:
                self._finish(r, {"type": "abort", "message": r.abort_message})
            else:
                live.append(r)
        decoding = [r for r in live if r.fed == len(r.input_ids)]
        for r in live:
            if r.fed < len(r.input_ids):
                try:
                    chunk = r.input_ids[r.fed: r.fed + self.prefill_chunk]
                    logits = model.forward(chunk, r.cache)
                    r.fed += len(chunk)
                    if r.fed == len(r.input_ids):  # prompt done: its logits give the first token
                        self._emit(r, logits)
                except Exception as e:
                    self._fail([r], e)
        if decoding:
            try:
                contexts = [r.cache.length for r in decoding] if self.pacer is not None else []
                logits = model.decode([r.output[-1] for r in decoding], [r.cache for r in decoding])
                if self.pacer is not None:  # before the tokens are handed out, as a GPU step would
                    self.pacer.finish(len(decoding), contexts)
                for r, row in zip(decoding, logits):
                    self._emit(r, row)
                if self.pacer is not None:
                    self.pacer.done()
            except Exception as e:
                self._fail([r for r in decoding if r in self._active], e)

    def _fail(self, requests: list[_Request], e: Exception) -> None:
        """Report an engine error on these requests and keep serving the others."""
        traceback.print_exc()
        for r in requests:
            self._finish(r, {"type": "abort", "message": f"engine error: {type(e).__name__}: {e}"}, keep_cache=False)

    def _emit(self, r: _Request, logits: torch.Tensor) -> None:
        token, logprob, top = sample(logits, r.params, r.generator, r.top_n)
        # log-probs first: a streaming reader takes len(output) and then reads that many of each
        r.logprobs.append(logprob)
        if r.top_n:
            r.top_logprobs.append(top)
        r.output.append(token)
        stops = set(r.params.stop_token_ids)
        if not r.params.ignore_eos:
            stops.update(self.spec.eos_ids)
        matched = self._stop_string(r) if r.params.stop and token not in stops else None
        if token in stops:
            self._finish(r, {"type": "stop", "matched": token})
        elif matched is not None:
            self._finish(r, {"type": "stop", "matched": matched})
        elif len(r.output) >= r.params.max_new_tokens:
            self._finish(r, {"type": "length", "length": len(r.output)})
        elif r.cache.length + 1 >= self.max_context:
            self._finish(r, {"type": "length", "length": len(r.output), "message": "context is full"})
        else:
            if r.on_step is not None:
                try:
                    r.on_step()
                except Exception:  # a broken callback must not kill the worker
                    traceback.print_exc()

    def _stop_string(self, r: _Request) -> str | None:
        tail = self.tokenizer.decode(r.output[-r.stop_tail_tokens:], skip_special_tokens=False)
        return next((s for s in r.params.stop if s in tail), None)
