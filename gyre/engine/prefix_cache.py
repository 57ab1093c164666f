"""Reuse of finished requests' KV caches for later requests that share a token prefix.

An agent's next call is its previous input + output + new messages, so the longest common
prefix with a cached sequence usually covers almost all of the prompt. This is the embedded
engine's small counterpart of SGLang's radix cache (which is why the router keeps an
execution on one endpoint). Not thread-safe: the engine calls it under its own lock.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from gyre.engine.qwen import KVCache


class PrefixCache:
    def __init__(self, budget_tokens: int = 1 << 20, max_entries: int = 256):
        self.budget_tokens = budget_tokens
        self.max_entries = max_entries
        self._entries: OrderedDict[int, tuple[torch.Tensor, KVCache]] = OrderedDict()
        self._next = 0
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _common(a: torch.Tensor, b: torch.Tensor) -> int:
        n = min(len(a), len(b))
        diff = (a[:n] != b[:n]).nonzero()
        return int(diff[0]) if len(diff) else n

    def lookup(self, ids: list[int]) -> tuple[KVCache | None, int]:
        """A fresh cache holding the longest cached prefix of ``ids`` (at most ``len(ids) - 1``
        tokens, since the last prompt token must be run to get logits) and its length. A hybrid
        model's cache resumes from its deepest stored state within that prefix (it may hold fewer
        tokens than were shared; the rest is recomputed)."""
        if not self._entries or len(ids) < 2:
            return None, 0
        query = torch.tensor(ids)
        best_key, best = None, 0
        for key, (tokens, _) in self._entries.items():
            n = self._common(tokens, query)
            if n > best:
                best_key, best = key, n
        best = min(best, len(ids) - 1)
        if best_key is None or best == 0:
            return None, 0
        self._entries.move_to_end(best_key)
        cache = self._entries[best_key][1].copy(best)
        return (cache, cache.length) if cache.length else (None, 0)

    def insert(self, ids: list[int], cache: KVCache) -> None:
        """Remember ``cache``, which holds exactly the positions of ``ids``."""
        if not ids or len(ids) != cache.length or len(ids) > self.budget_tokens:
            return
        tokens = torch.tensor(ids)
        # An entry that is a prefix of the new sequence is now redundant.
        for key in [k for k, (t, _) in self._entries.items()
                    if len(t) <= len(tokens) and self._common(t, tokens) == len(t)]:
            self.tokens -= len(self._entries.pop(key)[0])
        self._entries[self._next] = (tokens, cache)
        self._next += 1
        self.tokens += len(tokens)
        while self.tokens > self.budget_tokens or len(self._entries) > self.max_entries:
            _, (old, _) = self._entries.popitem(last=False)
            self.tokens -= len(old)

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = 0
