"""Routed experts per tree node, for routing replay (``train.routing_replay``).

The engine answers a call with the experts it routed every position of the call to (SGLang's
``return_routed_experts``: ``meta_info["routed_experts"]``, base64 of little-endian int32
``[prompt + output - 1, MoE layers, top_k]``; the whole input, a cached prefix included, the last
output token never being run). A tree stores that answer per *node and policy version*: each node
on the call's path keeps its own rows once per version that routed it (a shared prefix routed at
versions 0 and 2 is two entries; two calls at one version share one), as uint8 expert ids (uint16
past 255 experts), so storage grows with the tree's unique tokens times the versions it spans.

Which entry a training row replays, per node (``node_rows``): a target node uses the routing of
its own call (its policy version: what its tokens were sampled under); a context node the newest
entry (what the latest calls that continue it saw). Positions no entry covers (a leaf's last
token, calls recorded without routing) are ``MISSING`` and route freely in the trainer.
"""

from __future__ import annotations

import base64
from bisect import insort
from dataclasses import dataclass, field

import numpy as np

MISSING = -1  # a position whose routing was not recorded: the trainer routes it itself


def decode_routed_experts(b64: str, n_positions: int, moe_layers: int, top_k: int) -> np.ndarray:
    """SGLang's ``meta_info["routed_experts"]`` as int32 ``[n_positions, moe_layers, top_k]``;
    a clear error when its size does not fit the call (another model, a truncated answer)."""
    raw = np.frombuffer(base64.b64decode(b64), dtype="<i4")
    want = n_positions * moe_layers * top_k
    if raw.size != want:
        raise ValueError(f"routed_experts holds {raw.size} expert ids; {n_positions} positions x "
                         f"{moe_layers} MoE layers x top-{top_k} = {want} expected (is the engine "
                         f"serving this model?)")
    return raw.reshape(n_positions, moe_layers, top_k)


def encode_routed_experts(rows: np.ndarray) -> str:
    """The inverse of :func:`decode_routed_experts` (SGLang's encoding)."""
    return base64.b64encode(np.ascontiguousarray(rows, dtype="<i4").tobytes()).decode("ascii")


def storage_dtype(n_experts: int) -> np.dtype:
    return np.dtype(np.uint8 if n_experts <= 256 else np.uint16)  # ids 0..n-1


@dataclass
class RoutingTable:
    """Per (node, policy version): the expert ids of the node's first ``len(rows)`` positions
    (``[rows, moe_layers, top_k]``, uint8/uint16)."""

    moe_layers: int
    top_k: int
    n_experts: int
    entries: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    _versions: dict[int, list[int]] = field(default_factory=dict, repr=False)  # node -> sorted versions

    @property
    def dtype(self) -> np.dtype:
        return storage_dtype(self.n_experts)

    def put(self, node: int, version: int, rows: np.ndarray) -> None:
        if (node, version) not in self.entries:
            insort(self._versions.setdefault(node, []), version)
        self.entries[(node, version)] = rows

    def versions(self, node: int) -> list[int]:
        return list(self._versions.get(node, ()))

    def add_path(self, path_lengths: list[tuple[int, int]], version: int, routed: np.ndarray) -> int:
        """Store one call's routing ``routed`` ``[positions, L, k]`` along its path
        ``[(node id, tokens), ...]`` (root first) at ``version``; nodes that already have an entry
        at this version keep it (the engine's prefix cache answers the same for them). Returns the
        number of entries added or completed."""
        if routed.ndim != 3 or routed.shape[1:] != (self.moe_layers, self.top_k):
            raise ValueError(f"routing of shape {routed.shape}; [positions, {self.moe_layers}, "
                             f"{self.top_k}] expected")
        if len(routed) and (routed.min() < 0 or routed.max() >= self.n_experts):
            raise ValueError(f"expert ids outside 0..{self.n_experts - 1}")
        added, start = 0, 0
        for node, length in path_lengths:
            rows = routed[start:start + length]
            start += length
            # kept: the engine's prefix cache answers the same; a leaf's entry lacks its last
            # position until a later call continues through it
            if len(self.entries.get((node, version), ())) >= len(rows):
                continue
            self.put(node, version, rows.astype(self.dtype))
            added += 1
        return added

    def node_rows(self, node: int, length: int, own_version: int | None) -> np.ndarray:
        """int16 ``[length, L, k]`` for a training row: the entry at ``own_version`` (a target
        node's call) or else the newest, gaps filled from the other entries newest first;
        ``MISSING`` where none covers a position."""
        out = np.full((length, self.moe_layers, self.top_k), MISSING, np.int16)
        versions = self.versions(node)[::-1]
        if own_version in versions:
            versions.remove(own_version)
            versions.insert(0, own_version)
        filled = 0
        for v in versions:
            rows = self.entries[(node, v)]
            if len(rows) > filled:
                out[filled:len(rows)] = rows[filled:]
                filled = len(rows)
            if filled >= length:
                break
        return out

    def call_rows(self, path_lengths: list[tuple[int, int]], version: int) -> np.ndarray | None:
        """A call's routing as the engine returned it (``[positions - 1, L, k]``) from the entries
        at ``version``, or None when a node of its path has none (replaying a recorded call)."""
        parts, total = [], sum(length for _, length in path_lengths)
        for i, (node, length) in enumerate(path_lengths):
            rows = self.entries.get((node, version))
            if rows is None:
                if length:
                    return None
                continue
            if len(rows) < length and i < len(path_lengths) - 1:
                return None  # a gap inside the path
            parts.append(rows[:length])
        if not parts or sum(map(len, parts)) < total - 1:
            return None
        return np.concatenate(parts)[:total - 1].astype("<i4")


def path_lengths(tree, leaf: int) -> list[tuple[int, int]]:
    """``[(node id, tokens)]`` root first: the positions a call to ``leaf`` covers."""
    return [(n, len(tree.nodes[n].tokens)) for n in tree.path(leaf)]


def record_call_routing(tree, call, b64: str, shape: tuple[int, int, int]) -> int:
    """Store the engine's answer for ``call`` (a CallRecord just added to ``tree``): ``shape`` is
    (MoE layers, top_k, experts) of the served model. Returns the entries added."""
    layers, top_k, n_experts = shape
    if tree.routing is None:
        tree.routing = RoutingTable(layers, top_k, n_experts)
    lengths = path_lengths(tree, call.leaf)
    n = sum(length for _, length in lengths) - 1
    routed = decode_routed_experts(b64, n, layers, top_k)
    return tree.routing.add_path(lengths, call.policy_version, routed)


def row_routing(pieces) -> np.ndarray | None:
    """int16 ``[row tokens, L, k]`` for one training row made of materialization pieces (nodes in
    the order the row lays them out), or None when no execution of the row has routing."""
    tables = [p.execution.record.tree.routing for p in pieces]
    ref = next((t for t in tables if t is not None), None)
    if ref is None:
        return None
    parts = []
    for p, table in zip(pieces, tables):
        tree = p.execution.record.tree
        for n in p.nodes.tolist():
            node = tree.nodes[n]
            own = node.policy_version if node.is_target else None
            if table is None:
                parts.append(np.full((len(node.tokens), ref.moe_layers, ref.top_k), MISSING, np.int16))
            else:
                parts.append(table.node_rows(n, len(node.tokens), own))
    return np.concatenate(parts) if parts else np.zeros((0, ref.moe_layers, ref.top_k), np.int16)
