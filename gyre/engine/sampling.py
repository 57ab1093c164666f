"""Sampling parameters (SGLang's names) and the one sampling rule the engine uses.

The log-prob reported for a sampled token is its log-probability under the distribution it was
actually drawn from (the trainer reproduces this to compute importance ratios):

* ``temperature == 0`` (values below ``1e-6`` count as 0, as in SGLang): greedy, ``token = argmax(logits)``; the reported log-prob is
  ``log_softmax(logits)[token]`` (raw logits, no temperature, no filtering).
* ``temperature > 0``: ``z = logits / temperature``; top-k keeps the tokens whose ``z`` is at
  least the k-th largest ``z`` (``top_k <= 0`` or ``>= vocab``: off); top-p then keeps the
  smallest set of the most probable tokens (in ``softmax(z)``, sorted descending) whose
  cumulative probability reaches ``top_p`` (a token is kept iff the mass before it is
  ``< top_p``); everything else is set to ``-inf``. The token is drawn from
  ``p = softmax(z)`` over the kept set and the reported log-prob is ``log_softmax(z)[token]``
  over the kept set, i.e. renormalised after filtering.
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


def filtered_logprobs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """``log_softmax`` of the distribution used for sampling (see the module docstring)."""
    if temperature == 0:
        return torch.log_softmax(logits.float(), dim=-1)
    z = logits.float() / temperature
    if 0 < top_k < z.shape[-1]:
        kth = torch.topk(z, top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        probs = torch.softmax(z, dim=-1)
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop = torch.zeros_like(z, dtype=torch.bool)
        drop[order] = before >= top_p
        z = z.masked_fill(drop, float("-inf"))
    return torch.log_softmax(z, dim=-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
           top_n: int = 0) -> tuple[int, float, list[tuple[float, int]]]:
    """Draw one token; return ``(token_id, logprob, top)`` as defined in the module docstring.
    ``top`` holds the ``top_n`` most probable ``(logprob, token_id)`` of the same distribution."""
    logp = filtered_logprobs(logits, params.temperature, params.top_k, params.top_p)
    if params.temperature == 0:
        token = int(torch.argmax(logits))
    else:
        token = int(torch.multinomial(logp.exp(), 1, generator=generator))
    top: list[tuple[float, int]] = []
    if top_n > 0:
        vals, ids = torch.topk(logp, min(top_n, logp.shape[-1]))
        top = list(zip(vals.tolist(), ids.tolist()))
    return token, float(logp[token]), top
