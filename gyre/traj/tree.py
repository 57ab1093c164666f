"""Per-execution trajectory tree: message-level nodes holding exact token segments.

Every model call of an execution adds one root-to-leaf path: one node per input message (reused
when the same message was already recorded under the same parent with the same tokens) and one
*target* node holding the generation prompt followed by the sampled output tokens. Divergences
(context compaction, a sub-agent's own system prompt, a retry) create siblings; nothing already
recorded is ever rewritten (ARCHITECTURE.md invariant 2). Leaves are candidate trajectories.

A node's tokens are ``tokens[:target_start]`` context then ``tokens[target_start:]`` targets;
``logprobs`` align with the targets. Context nodes have ``target_start == len(tokens)``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from gyre.traj.routing import RoutingTable

ROOT = -1  # parent id of a tree's first-level nodes (the forest's virtual root)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p")  # stored per call


@dataclass
class Node:
    id: int
    parent: int
    key: str                      # message identity (hash of the canonical message) under `parent`
    tokens: np.ndarray            # int32
    target_start: int
    logprobs: np.ndarray          # float32, len(tokens) - target_start
    message_role: str             # system | user | assistant | tool | ...
    agent_role: str               # main | subagent:<name> | compactor | ...
    policy_version: int = -1      # weight version that produced the targets (-1 for context)
    call_index: int = -1          # the call that created this node

    @property
    def is_target(self) -> bool:
        return self.target_start < len(self.tokens)

    @property
    def n_targets(self) -> int:
        return len(self.tokens) - self.target_start


@dataclass
class Segment:
    """One input message as rendered for a call: its key, exact tokens and role."""

    key: str
    tokens: list[int] | np.ndarray
    message_role: str


@dataclass
class CallRecord:
    index: int
    leaf: int                     # the target node this call produced
    agent_role: str
    n_input: int
    n_output: int
    weight_version: str
    policy_version: int
    endpoint: str = ""
    finish_reason: str = ""
    t_start: float = 0.0
    t_end: float = 0.0
    # the parameters the engine sampled with (SGLang's names; temperature 0 = greedy)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    # what the engine returned (output ids and log-probs) when the call was recorded, for the
    # token-identity audit (gyre.traj.audit); 0 = not recorded (a shard older than schema 2)
    output_digest: int = 0

    @property
    def logprob_temperature(self) -> float:
        """The divisor of the logits in the log-probs the engine reported: SGLang reports
        log_softmax(logits / T), and raw log_softmax(logits) for greedy calls."""
        return self.temperature if self.temperature > 0 else 1.0


def output_digest(tokens, logprobs) -> int:
    """A signed 64-bit digest of a call's output ids (int32) and log-probs (float32)."""
    h = hashlib.blake2b(np.ascontiguousarray(tokens, dtype=np.int32).tobytes(), digest_size=8)
    h.update(np.ascontiguousarray(logprobs, dtype=np.float32).tobytes())
    return int.from_bytes(h.digest(), "little", signed=True)


@dataclass
class TreeStats:
    calls: int
    leaves: int
    unique_nodes: int
    expanded_nodes: int           # node occurrences if every leaf path were expanded on its own
    unique_tokens: int
    expanded_tokens: int
    target_tokens: int            # unique target tokens

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class TrajectoryTree:
    nodes: list[Node] = field(default_factory=list)
    calls: list[CallRecord] = field(default_factory=list)
    # parent -> key -> node ids in creation order (one key can have several token realisations,
    # e.g. the same assistant text sampled twice with different ids)
    _children: dict[int, dict[str, list[int]]] = field(default_factory=dict, repr=False)
    # routed experts per (node, policy version), when the engine was asked (train.routing_replay)
    routing: "RoutingTable | None" = field(default=None, repr=False)

    # -- building -------------------------------------------------------------------------
    def find_child(self, parent: int, key: str) -> int | None:
        """The most recent node recorded under ``parent`` for message ``key``."""
        ids = self._children.get(parent, {}).get(key)
        return ids[-1] if ids else None

    def children(self, parent: int) -> list[int]:
        return [i for ids in self._children.get(parent, {}).values() for i in ids]

    def _child_with_tokens(self, parent: int, key: str, tokens: np.ndarray,
                           target_start: int | None) -> int | None:
        """A child with this key and tokens; ``target_start=None`` also accepts a target node."""
        for nid in self._children.get(parent, {}).get(key, ()):
            n = self.nodes[nid]
            if target_start in (None, n.target_start) and np.array_equal(n.tokens, tokens):
                return nid
        return None

    def _new_node(self, parent: int, key: str, tokens: np.ndarray, target_start: int,
                  logprobs: np.ndarray, message_role: str, agent_role: str,
                  policy_version: int, call_index: int) -> int:
        nid = len(self.nodes)
        self.nodes.append(Node(nid, parent, key, tokens, target_start, logprobs, message_role,
                               agent_role, policy_version, call_index))
        self._children.setdefault(parent, {}).setdefault(key, []).append(nid)
        return nid

    def add_call(self, segments: list[Segment], target_key: str, prompt_tokens: list[int],
                 output_tokens: list[int], logprobs: list[float], *, agent_role: str,
                 weight_version: str = "0", policy_version: int = 0, endpoint: str = "",
                 finish_reason: str = "", t_start: float = 0.0, t_end: float = 0.0,
                 sampling: dict | None = None, path: tuple[int, int, int] | None = None) -> CallRecord:
        """Record one call: its input messages, then its generation prompt + sampled output.

        ``sampling``: the engine's sampling parameters (``temperature``, ``top_p``, ``top_k``,
        ``min_p``; missing ones take the engine's defaults).

        Returns the call record; its ``leaf`` is the target node. Existing nodes are reused
        only when key *and* tokens match, so recorded history is never altered. ``path``
        ``(k, node, tokens)``: the first k segments are the tree's path ending at ``node``
        (their tokens in all), as the caller's walk found them, so they are not compared again.
        """
        if len(logprobs) != len(output_tokens):
            raise ValueError(f"{len(logprobs)} log-probs for {len(output_tokens)} output tokens")
        index = len(self.calls)
        parent, n_input, skip = ROOT, 0, 0
        if path is not None:
            skip, parent, n_input = path
            if not 0 < skip <= len(segments) or self.nodes[parent].key != segments[skip - 1].key:
                raise ValueError(f"path {path[:2]} does not end at segment {skip - 1}'s node")
        for seg in segments[skip:]:
            toks = np.asarray(seg.tokens, dtype=np.int32)
            n_input += len(toks)
            # an earlier output re-sent as context continues *through* its target node (so
            # targets are interior and leaves are whole trajectories); its context is unchanged
            nid = self._child_with_tokens(parent, seg.key, toks, None)
            if nid is None:
                nid = self._new_node(parent, seg.key, toks, len(toks), np.zeros(0, np.float32),
                                     seg.message_role, agent_role, -1, index)
            parent = nid
        toks = np.asarray(list(prompt_tokens) + list(output_tokens), dtype=np.int32)
        n_input += len(prompt_tokens)
        leaf = self._child_with_tokens(parent, target_key, toks, len(prompt_tokens))
        if leaf is None:
            leaf = self._new_node(parent, target_key, toks, len(prompt_tokens),
                                  np.asarray(logprobs, dtype=np.float32), "assistant",
                                  agent_role, policy_version, index)
        sp = {k: v for k, v in (sampling or {}).items() if k in SAMPLING_FIELDS and v is not None}
        rec = CallRecord(index, leaf, agent_role, n_input, len(output_tokens), weight_version,
                         policy_version, endpoint, finish_reason, t_start, t_end, **sp,
                         output_digest=output_digest(output_tokens, logprobs))
        self.calls.append(rec)
        return rec

    # -- reading --------------------------------------------------------------------------
    def path(self, node_id: int) -> list[int]:
        """Node ids from the first level down to ``node_id``."""
        out = []
        while node_id != ROOT:
            out.append(node_id)
            node_id = self.nodes[node_id].parent
        return out[::-1]

    def leaves(self) -> list[int]:
        has_child = {n.parent for n in self.nodes}
        return [n.id for n in self.nodes if n.id not in has_child]

    def call_input_ids(self, call: CallRecord) -> np.ndarray:
        """The exact input ids the engine received for ``call`` (its path minus the output)."""
        path = self.path(call.leaf)
        parts = [self.nodes[i].tokens for i in path[:-1]]
        leaf = self.nodes[path[-1]]
        parts.append(leaf.tokens[: leaf.target_start])
        return np.concatenate(parts) if parts else np.zeros(0, np.int32)

    def call_output_ids(self, call: CallRecord) -> np.ndarray:
        leaf = self.nodes[call.leaf]
        return leaf.tokens[leaf.target_start:]

    def stats(self) -> TreeStats:
        leaves = self.leaves()
        node_len = np.array([len(n.tokens) for n in self.nodes], dtype=np.int64)
        # expanded counts: walk each leaf path once (memoised depth and token depth)
        depth = np.zeros(len(self.nodes), np.int64)
        tok_depth = np.zeros(len(self.nodes), np.int64)
        for n in self.nodes:  # parents are always created before children
            depth[n.id] = 1 + (depth[n.parent] if n.parent != ROOT else 0)
            tok_depth[n.id] = node_len[n.id] + (tok_depth[n.parent] if n.parent != ROOT else 0)
        return TreeStats(
            calls=len(self.calls),
            leaves=len(leaves),
            unique_nodes=len(self.nodes),
            expanded_nodes=int(depth[leaves].sum()) if leaves else 0,
            unique_tokens=int(node_len.sum()),
            expanded_tokens=int(tok_depth[leaves].sum()) if leaves else 0,
            target_tokens=int(sum(n.n_targets for n in self.nodes)),
        )

    # -- rebuilding (from a shard) ---------------------------------------------------------
    @classmethod
    def from_parts(cls, nodes: list[Node], calls: list[CallRecord]) -> "TrajectoryTree":
        tree = cls()
        for i, n in enumerate(nodes):
            if n.id != i or (n.parent != ROOT and not 0 <= n.parent < i):
                raise ValueError(f"node {i}: parent {n.parent} must be ROOT or an earlier node")
            tree.nodes.append(n)
            tree._children.setdefault(n.parent, {}).setdefault(n.key, []).append(n.id)
        for c in calls:
            if not 0 <= c.leaf < len(nodes):
                raise ValueError(f"call {c.index}: leaf {c.leaf} is not a node")
        tree.calls = list(calls)
        return tree
