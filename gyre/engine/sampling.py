"""Sampling parameters (SGLang's names) and the one sampling rule the engine uses.

The token is drawn from the *filtered* distribution; the reported log-prob follows SGLang's
definition (``Sampler.forward`` in ``python/sglang/srt/layers/sampler.py``, default
``SGLANG_RETURN_ORIGINAL_LOGPROB`` off): the log-probability under the *temperature-scaled,
unfiltered* distribution, i.e. ``log_softmax(logits / temperature)[token]`` over the whole
vocabulary. Top-k, top-p and min-p decide which token can be drawn, not the reported value.
The trainer reproduces exactly this (divide by the call's temperature, no filtering):

* ``temperature == 0`` (values below ``1e-6`` count as 0, as in SGLang): greedy, ``token = argmax(logits)``; the reported log-prob is
  ``log_softmax(logits)[token]`` (raw logits: the trainer divides by 1).
* ``temperature > 0``: ``z = logits / temperature``, ``p = softmax(z)``; top-k keeps the tokens
  whose ``z`` is at least the k-th largest (``top_k <= 0`` or ``>= vocab``: off); top-p then
  keeps the smallest set of the most probable tokens (sorted descending) whose cumulative
  probability reaches ``top_p`` (a token is kept iff the mass before it is ``< top_p``); min-p
  keeps the tokens with ``p >= min_p * max(p)``. The token is drawn from ``p`` renormalised over
  the kept set; the reported log-prob (and ``top_logprobs``) is ``log_softmax(z)[token]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
GREEDY_BELOW = 1e-6  # SGLang's _SAMPLING_EPS: smaller temperatures mean greedy


class BadRequest(ValueError):
    """A request field is missing, of the wrong type or out of range (answered with 400)."""


@dataclass
class SamplingParams:
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings: generation ends in the engine
    no_stop_trim: bool = False


MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's range
MAX_STOP_STRINGS = 64


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def parse_sampling_params(raw, vocab_size: int, max_new_tokens_cap: int) -> SamplingParams:
    """Validate ``sampling_params`` from a request; errors name the field and what is allowed."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest(f"sampling_params must be an object, got {type(raw).__name__}")
    known = {f for f in SamplingParams.__dataclass_fields__}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise BadRequest(f"sampling_params: unknown key(s) {unknown}; supported: {sorted(known)}")
    p = SamplingParams()
    if "max_new_tokens" in raw and raw["max_new_tokens"] is not None:
        v = raw["max_new_tokens"]
        if not _is_int(v) or v < 1:
            raise BadRequest(f"sampling_params.max_new_tokens must be an integer >= 1, got {v!r}")
        if v > max_new_tokens_cap:
            raise BadRequest(f"sampling_params.max_new_tokens={v} exceeds this engine's cap "
                             f"{max_new_tokens_cap} (engine.max_new_tokens_cap)")
        p.max_new_tokens = v
    if raw.get("temperature") is not None:
        v = raw["temperature"]
        if not _is_num(v) or not 0 <= v < float("inf"):
            raise BadRequest(f"sampling_params.temperature must be a number >= 0, got {v!r}")
        p.temperature = 0.0 if v < GREEDY_BELOW else float(v)
    if raw.get("top_p") is not None:
        v = raw["top_p"]
        if not _is_num(v) or not 0 < v <= 1:
            raise BadRequest(f"sampling_params.top_p must be a number in (0, 1], got {v!r}")
        p.top_p = float(v)
    if raw.get("top_k") is not None:
        v = raw["top_k"]
        if not _is_int(v) or v == 0 or v < -1:
            raise BadRequest(f"sampling_params.top_k must be -1 (off) or an integer >= 1, got {v!r}")
        p.top_k = v
    if raw.get("min_p") is not None:
        v = raw["min_p"]
        if not _is_num(v) or not 0 <= v <= 1:
            raise BadRequest(f"sampling_params.min_p must be a number in [0, 1], got {v!r}")
        p.min_p = float(v)
    if raw.get("stop_token_ids") is not None:
        v = raw["stop_token_ids"]
        if not isinstance(v, list) or not all(_is_int(t) and 0 <= t < vocab_size for t in v):
            raise BadRequest(f"sampling_params.stop_token_ids must be a list of token ids in [0, {vocab_size}), got {v!r}")
        p.stop_token_ids = list(v)
    for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
        if raw.get(name) is not None:
            if not isinstance(raw[name], bool):
                raise BadRequest(f"sampling_params.{name} must be true or false, got {raw[name]!r}")
            setattr(p, name, raw[name])
    if raw.get("sampling_seed") is not None:
        v = raw["sampling_seed"]
        if not _is_int(v) or not 0 <= v <= MAX_SEED:
            raise BadRequest(f"sampling_params.sampling_seed must be an integer in [0, 2**64 - 1], got {v!r}")
        p.sampling_seed = v
    if raw.get("stop") is not None:
        v = raw["stop"]
        v = [v] if isinstance(v, str) else v
        if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v) or len(v) > MAX_STOP_STRINGS:
            raise BadRequest(f"sampling_params.stop must be a non-empty string or a list of up to "
                             f"{MAX_STOP_STRINGS} non-empty strings, got {raw['stop']!r}")
        p.stop = list(v)
    return p


def reported_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The log-probs SGLang reports: ``log_softmax(logits / T)``, T = 1 for greedy, no filtering."""
    return torch.log_softmax(logits.float() / (temperature or 1.0), dim=-1)


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The (unnormalised) distribution a token is drawn from: ``softmax(logits / T)`` with every
    token outside the top-k / top-p / min-p set zeroed (see the module docstring)."""
    z = logits.float() / params.temperature
    if 0 < params.top_k < z.shape[-1]:
        kth = torch.topk(z, params.top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    probs = torch.softmax(z, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop = torch.zeros_like(probs, dtype=torch.bool)
        drop[order] = before >= params.top_p
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
           top_n: int = 0) -> tuple[int, float, list[tuple[float, int]]]:
    """Draw one token; return ``(token_id, logprob, top)`` as defined in the module docstring.
    ``top`` holds the ``top_n`` most probable ``(logprob, token_id)`` of the reported distribution."""
    logp = reported_logprobs(logits, params.temperature)
    if params.temperature == 0:
        token = int(torch.argmax(logits))
    else:
        token = int(torch.multinomial(sampling_probs(logits, params), 1, generator=generator))
    top: list[tuple[float, int]] = []
    if top_n > 0:
        vals, ids = torch.topk(logp, min(top_n, logp.shape[-1]))
        top = list(zip(vals.tolist(), ids.tolist()))
    return token, float(logp[token]), top
