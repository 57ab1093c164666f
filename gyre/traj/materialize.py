"""Materialization: the selected trajectories of one training step -> MicroBatches.

Two layouts give the same loss and gradients:

* ``expanded``: one row per selected trajectory (its root-to-leaf path), causal, positions
  0..L-1. Shared prefixes are repeated, but a target node shared by several selected paths is a
  target in exactly one row (the first, in selection order), so it counts once.
* ``tree``: each unique node of the union of selected paths appears once per row, in pre-order,
  so every subtree is a contiguous span; attention follows ancestry and positions are the token
  depth from the root (what the engine saw as positions when it sampled).

Loss weights are fixed for the whole step before any packing: every target token of execution e
weighs 1/(unique selected target tokens of e)/(executions in the step). Summed over micro-batches
and data-parallel ranks, each execution therefore contributes its token-mean loss with equal
weight, however it is split (ARCHITECTURE.md: the execution, not the token, is the unit).

Micro-batches hold at most ``micro_batch_tokens`` padded tokens (B x S). Whole executions are
packed together where they fit; a larger one is cut into pieces along its leaf paths (pre-order,
so consecutive paths share prefixes), each piece repeating the prefix it needs.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Sequence, TypeVar

import numpy as np

from gyre.config import Layout
from gyre.advantage import ESTIMATORS, group_advantages
from gyre.traj.record import ExecutionRecord
from gyre.traj.routing import row_routing
from gyre.traj.select import SelectionSpec, select_leaves
from gyre.traj.tree import ROOT, TrajectoryTree

if TYPE_CHECKING:
    from gyre.batch import MicroBatch

LAYOUTS = ("tree", "expanded")


# -- per-execution preparation -----------------------------------------------------------------

@dataclass
class TreeArrays:
    """Flat numpy view of a tree, so rows are gathered with vector ops instead of node loops."""

    parent: np.ndarray        # int64, ROOT for first-level nodes
    length: np.ndarray        # int64 tokens per node
    target_start: np.ndarray  # int64
    tok_off: np.ndarray       # int64 offset of each node in `tokens`
    tokens: np.ndarray        # int32, all nodes concatenated
    lp_off: np.ndarray        # int64 offset of each node's targets in `logprobs`
    logprobs: np.ndarray      # float32, all target log-probs concatenated
    depth: np.ndarray         # int64 token offset of each node's first token from the root
    version: np.ndarray       # int64 policy version of each node's targets (-1: context / unknown)
    temperature: np.ndarray   # float32 logit divisor of each node's targets (its call's; 1 if none)

    @classmethod
    def from_tree(cls, tree: TrajectoryTree) -> "TreeArrays":
        nodes = tree.nodes
        n = len(nodes)
        parent = np.fromiter((x.parent for x in nodes), np.int64, n)
        length = np.fromiter((len(x.tokens) for x in nodes), np.int64, n)
        tstart = np.fromiter((x.target_start for x in nodes), np.int64, n)
        depth = np.zeros(n, np.int64)
        for i in range(n):  # parents precede children (TrajectoryTree invariant)
            p = parent[i]
            if p != ROOT:
                depth[i] = depth[p] + length[p]
        empty_i, empty_f = np.zeros(0, np.int32), np.zeros(0, np.float32)
        call = np.fromiter((x.call_index for x in nodes), np.int64, n)
        divisor = np.asarray([c.logprob_temperature for c in tree.calls] or [1.0], np.float32)
        return cls(
            parent=parent, length=length, target_start=tstart,
            tok_off=_exclusive_cumsum(length),
            tokens=np.concatenate([np.asarray(x.tokens, np.int32) for x in nodes] or [empty_i]),
            lp_off=_exclusive_cumsum(length - tstart),
            logprobs=np.concatenate([np.asarray(x.logprobs, np.float32) for x in nodes] or [empty_f]),
            depth=depth,
            version=np.fromiter((x.policy_version for x in nodes), np.int64, n),
            temperature=np.where((call >= 0) & (call < len(tree.calls)),
                                 divisor[np.clip(call, 0, len(divisor) - 1)], np.float32(1.0)),
        )

    def is_target(self, nodes: np.ndarray) -> np.ndarray:
        return self.target_start[nodes] < self.length[nodes]


@dataclass
class SelectedExecution:
    """One execution's part of a step: its selected paths and step-wide loss scalars."""

    index: int                # execution_index in the MicroBatches (position in the step)
    record: ExecutionRecord
    leaves: list[int]         # selected leaves, selection (rank) order
    arrays: TreeArrays
    nodes: np.ndarray         # union of the selected root-to-leaf paths, pre-order
    advantage: float
    weight: float             # loss weight of each of its target tokens
    staleness: int            # the execution's oldest lag (admission); tokens carry their own
    node_lag: np.ndarray      # int64 per node: step version - the node's policy version

    @property
    def n_tokens(self) -> int:
        return int(self.arrays.length[self.nodes].sum())

    @property
    def n_targets(self) -> int:
        a = self.arrays
        return int((a.length[self.nodes] - a.target_start[self.nodes]).sum())


@dataclass
class StepBatch:
    executions: list[SelectedExecution]
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (execution_id, reason)


def union_preorder(parent: np.ndarray, leaves: Sequence[int]) -> np.ndarray:
    """Nodes on the root paths of ``leaves``, in pre-order (children by id): subtrees contiguous."""
    seen: set[int] = set()
    for leaf in leaves:
        n = int(leaf)
        while n != ROOT and n not in seen:  # stop at the first node another path already added
            seen.add(n)
            n = int(parent[n])
    kids: dict[int, list[int]] = {}
    for n in sorted(seen):
        kids.setdefault(int(parent[n]), []).append(n)
    order: list[int] = []
    stack = kids.get(ROOT, [])[::-1]
    while stack:
        n = stack.pop()
        order.append(n)
        stack.extend(kids.get(n, [])[::-1])
    return np.asarray(order, np.int64)


def prepare_step(records: Sequence[ExecutionRecord], spec: SelectionSpec, *, step_version: int,
                 estimator: str = "grpo", eps: float = 1e-6, step_executions: int | None = None) -> StepBatch:
    """Select trajectories and fix advantages, weights and staleness for one training step.

    ``step_executions``: how many executions the whole step trains, when ``records`` are only
    part of it (the head materializes a step group by group as groups are admitted); by default
    the kept records are the whole step.

    Group baselines use every record given (grouped by (task, group)), including ones that end up
    with no target token; those are returned in ``skipped`` and do not count in the step's
    execution total.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"advantage estimator {estimator!r}: choose one of {', '.join(ESTIMATORS)}")
    rewards = np.array([r.reward for r in records], np.float64)
    bad = [r.execution_id for r, x in zip(records, rewards) if not np.isfinite(x)]
    if bad:
        raise ValueError(f"executions without a finite reward cannot train: {bad[:5]}")
    keys: dict[tuple[str, int], int] = {}
    groups = [keys.setdefault((r.task, r.group), len(keys)) for r in records]
    adv = group_advantages(rewards, np.array(groups, np.int64), estimator, eps) if records else np.zeros(0)

    kept, skipped = [], []
    for rec, a in zip(records, adv):
        leaves = select_leaves(rec.tree, spec)
        arrays = TreeArrays.from_tree(rec.tree)
        nodes = union_preorder(arrays.parent, leaves)
        staleness = step_version - rec.min_version
        # each token's own lag: a node's policy version, the execution's oldest if not known
        lag = np.where(arrays.version >= 0, step_version - arrays.version, staleness)
        sel = SelectedExecution(len(kept), rec, leaves, arrays, nodes, float(a), 0.0, staleness, lag)
        if sel.n_targets == 0:
            skipped.append((rec.execution_id, "no trajectory selected" if not leaves
                            else "selected trajectories hold no target token"))
            continue
        kept.append(sel)
    n_step = step_executions or len(kept)
    for sel in kept:
        sel.weight = 1.0 / sel.n_targets / n_step
    return StepBatch(kept, skipped)


# -- pieces: ancestor-closed node sets that go into a row --------------------------------------

@dataclass
class Piece:
    execution: SelectedExecution
    nodes: np.ndarray         # pre-order, ancestor-closed
    targets: np.ndarray       # target nodes whose tokens this piece carries (each once per step)

    @property
    def n_tokens(self) -> int:
        return int(self.execution.arrays.length[self.nodes].sum())


def _assign_targets(e: SelectedExecution, node_sets: list[np.ndarray]) -> list[Piece]:
    """Pieces in order; a target node is carried by the first piece holding it. Pieces left
    without targets are dropped: they would compute tokens that train nothing."""
    done: set[int] = set()
    out = []
    for nodes in node_sets:
        cand = nodes[e.arrays.is_target(nodes)]
        new = np.asarray([n for n in cand.tolist() if n not in done], np.int64)
        done.update(new.tolist())
        if len(new):
            out.append(Piece(e, nodes, new))
    return out


def _paths(e: SelectedExecution, leaves: Sequence[int]) -> tuple[dict[int, np.ndarray], dict[int, int]]:
    """Root-to-leaf node ids and token length of each leaf's path."""
    paths = {leaf: np.asarray(e.record.tree.path(leaf), np.int64) for leaf in leaves}
    return paths, {leaf: int(e.arrays.length[p].sum()) for leaf, p in paths.items()}


def _check_fits(e: SelectedExecution, leaf: int, n: int, budget: int) -> None:
    if n > budget:
        raise ValueError(f"execution {e.record.execution_id}: trajectory to leaf {leaf} has {n} "
                         f"tokens, more than train.micro_batch_tokens={budget}; raise the budget")


def expanded_pieces(e: SelectedExecution, budget: int) -> list[Piece]:
    """One piece (row) per selected trajectory, in selection order."""
    paths, lengths = _paths(e, e.leaves)
    for leaf in e.leaves:
        _check_fits(e, leaf, lengths[leaf], budget)
    return _assign_targets(e, [paths[leaf] for leaf in e.leaves])


def tree_pieces(e: SelectedExecution, budget: int) -> list[Piece]:
    """The whole union as one piece if it fits, else greedy runs of leaf paths in pre-order."""
    if e.n_tokens <= budget:
        return _assign_targets(e, [e.nodes])
    rank = np.empty(int(e.nodes.max()) + 1, np.int64)
    rank[e.nodes] = np.arange(len(e.nodes))
    leaves = sorted(e.leaves, key=lambda n: rank[n])
    paths, lengths = _paths(e, leaves)
    length = e.arrays.length
    sets: list[np.ndarray] = []
    cur: set[int] = set()
    used = 0
    for leaf in leaves:
        _check_fits(e, leaf, lengths[leaf], budget)
        new = [n for n in paths[leaf].tolist() if n not in cur]
        add = int(length[new].sum()) if new else 0
        if cur and used + add > budget:
            sets.append(np.asarray(sorted(cur, key=lambda n: rank[n]), np.int64))
            cur, used = set(), 0
            new, add = paths[leaf].tolist(), lengths[leaf]
        cur.update(new)
        used += add
    if cur:
        sets.append(np.asarray(sorted(cur, key=lambda n: rank[n]), np.int64))
    return _assign_targets(e, sets)


# -- packing pieces into micro-batches ---------------------------------------------------------

T = TypeVar("T")


def best_fit(units: Sequence[T], size: Callable[[T], int], capacity: Callable[[T], int]
             ) -> list[list[T]]:
    """Best-fit bin packing in the given order: each unit goes to the open bin with the least
    room that still takes it, else opens a bin of ``capacity(unit)``. O(n log n)."""
    bins: list[list[T]] = []
    room: list[tuple[int, int]] = []  # sorted (free space, bin index)
    for u in units:
        s = size(u)
        i = bisect_left(room, (s, -1))
        if i < len(room):
            free, b = room.pop(i)
        else:
            free, b = capacity(u), len(bins)
            bins.append([])
        bins[b].append(u)
        if free - s > 0:
            insort(room, (free - s, b))
    return bins


def balanced(units: Sequence[T], size: Callable[[T], int], n: int, capacity: int) -> list[list[T]] | None:
    """The units (largest first) in ``n`` bins of ``capacity`` with loads as even as it can
    (longest-processing-time: each unit to the least-loaded bin), or None where one does not fit.

    Why not best-fit's bins alone: trainers take micro-batches by progress, so a step's training
    ends with its largest micro-batches; best-fit fills bins to the brim and leaves one small
    remainder (a live group of 4.3K tokens went 3.7K + 0.55K at a 4,096 budget, and three trainers
    then finished a step's eight micro-batches 4.7 s apart). The same number of bins, evened out,
    costs no more micro-batches. With equal capacities the least-loaded bin is the one to try: if
    the unit does not fit there it fits nowhere."""
    bins: list[list[T]] = [[] for _ in range(n)]
    loads = [(0, i) for i in range(n)]  # a heap of (load, bin): ties go to the lower bin
    for u in units:
        load, i = heapq.heappop(loads)
        load += size(u)
        if load > capacity:
            return None
        bins[i].append(u)
        heapq.heappush(loads, (load, i))
    return [b for b in bins if b]


@dataclass
class MicroBatchPlan:
    """Rows of pieces; cheap to keep and send, turned into tensors by `build_micro_batch`."""

    rows: list[list[Piece]]

    def row_lengths(self) -> list[int]:
        return [sum(p.n_tokens for p in row) for row in self.rows]

    @property
    def tokens(self) -> int:
        return sum(self.row_lengths())

    @property
    def padded_tokens(self) -> int:
        lengths = self.row_lengths()
        return len(lengths) * max(lengths, default=0)


def plan_micro_batches(executions: Sequence[SelectedExecution], layout: str,
                       micro_batch_tokens: int) -> list[MicroBatchPlan]:
    """Pack the pieces of ``executions`` into micro-batches of at most B*S <= micro_batch_tokens."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    budget = int(micro_batch_tokens)
    if layout == Layout.TREE:
        # one row per micro-batch; each unit is a whole execution or one piece of a large one
        units = [p for e in executions for p in tree_pieces(e, budget)]
        units.sort(key=lambda p: -p.n_tokens)  # stable: ties keep step order
        bins = best_fit(units, lambda p: p.n_tokens, lambda p: budget)
        bins = balanced(units, lambda p: p.n_tokens, len(bins), budget) or bins
        return [MicroBatchPlan([row]) for row in bins]
    # expanded: units are an execution's rows together when they fit, else single rows. Sorted by
    # longest row, a bin's S is its first unit's; its capacity is then a count of rows.
    groups: list[list[Piece]] = []
    for e in executions:
        rows = expanded_pieces(e, budget)
        if rows and len(rows) * max(p.n_tokens for p in rows) <= budget:
            groups.append(rows)
        else:
            groups.extend([r] for r in rows)
    groups.sort(key=lambda g: -max(p.n_tokens for p in g))
    bins = best_fit(groups, len, lambda g: budget // max(p.n_tokens for p in g))
    return [MicroBatchPlan([[p] for g in b for p in g]) for b in bins]


# -- tensors -----------------------------------------------------------------------------------

def _exclusive_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(len(x), np.int64)
    if len(x) > 1:
        np.cumsum(x[:-1], out=out[1:])
    return out


def _gather(off: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenated ranges [off[i], off[i]+lens[i]) as one index array."""
    total = int(lens.sum())
    return np.repeat(off - _exclusive_cumsum(lens), lens) + np.arange(total)


@dataclass
class _RowParts:
    tokens: list[np.ndarray] = field(default_factory=list)
    positions: list[np.ndarray] = field(default_factory=list)
    span_end: list[np.ndarray] = field(default_factory=list)  # end of each token's node subtree
    targets: list[dict] = field(default_factory=list)
    length: int = 0


def _add_piece(row: _RowParts, p: Piece) -> None:
    """Append one piece at the end of a row: tokens, depths, subtree spans and targets."""
    a, nodes = p.execution.arrays, p.nodes
    m = len(nodes)
    lens = a.length[nodes]
    start = row.length + _exclusive_cumsum(lens)           # row position of each node
    lookup = {n: i for i, n in enumerate(nodes.tolist())}
    lpar = np.asarray([lookup.get(int(x), -1) for x in a.parent[nodes]], np.int64)
    # subtree token sizes (reverse pre-order) and last token position on each node's path
    sub = lens.copy()
    for i in range(m - 1, -1, -1):
        if lpar[i] >= 0:
            sub[lpar[i]] += sub[i]
    last = start + lens - 1
    for i in range(m):
        if lens[i] == 0:
            last[i] = last[lpar[i]] if lpar[i] >= 0 else -1
    idx = _gather(a.tok_off[nodes], lens)
    rel = np.arange(len(idx)) - np.repeat(_exclusive_cumsum(lens), lens)  # offset in its node
    row.tokens.append(a.tokens[idx])
    row.positions.append(np.repeat(a.depth[nodes], lens) + rel)
    row.span_end.append(np.repeat(start + sub, lens))

    t_local = np.asarray([lookup[int(t)] for t in p.targets], np.int64)
    ts, counts = a.target_start[p.targets], a.length[p.targets] - a.target_start[p.targets]
    k = np.repeat(ts, counts) + (np.arange(int(counts.sum())) - np.repeat(_exclusive_cumsum(counts), counts))
    tok_pos = np.repeat(start[t_local], counts) + k
    # a token's predictor is the previous token in its node, or the last one on its parent path
    parent_last = np.where(lpar[t_local] >= 0, last[np.maximum(lpar[t_local], 0)], -1)
    pred = np.where(k > 0, tok_pos - 1, np.repeat(parent_last, counts))
    keep = pred >= 0  # the very first token of a tree has no predictor
    e = p.execution
    n = int(keep.sum())
    row.targets.append(dict(
        pred=pred[keep],
        target=a.tokens[np.repeat(a.tok_off[p.targets], counts) + k][keep],
        old=a.logprobs[np.repeat(a.lp_off[p.targets] - ts, counts) + k][keep],
        adv=np.full(n, e.advantage, np.float32), weight=np.full(n, e.weight, np.float64),
        stale=np.repeat(e.node_lag[p.targets], counts)[keep],
        temp=np.repeat(a.temperature[p.targets], counts)[keep],
        exe=np.full(n, e.index, np.int64),
        node=np.repeat(p.targets, counts)[keep], offset=k[keep],
    ))
    row.length += int(lens.sum())


def build_wire(plan: MicroBatchPlan, routing: bool = False) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """One plan's micro-batch in its wire form (`gyre.batch.to_wire`: numpy arrays, fields that
    are None left out), plus each target's key (execution_index, node id, token offset).
    Numpy only: the head builds and sends micro-batches without importing torch.
    ``routing``: carry the recorded routed experts (routing replay) when the rows have them."""
    rows = []
    for pieces in plan.rows:
        row = _RowParts()
        for p in pieces:
            _add_piece(row, p)
        rows.append(row)
    B, S = len(rows), max((r.length for r in rows), default=0)
    ids = np.zeros((B, S), np.int64)
    pos = np.zeros((B, S), np.int64)
    end = np.zeros((B, S), np.int64)  # padding keys end at 0: nobody attends to them
    cols = []
    for b, r in enumerate(rows):
        if r.length:
            ids[b, :r.length] = np.concatenate(r.tokens)
            pos[b, :r.length] = np.concatenate(r.positions)
            end[b, :r.length] = np.concatenate(r.span_end)
        for t in r.targets:
            cols.append({**t, "pred": t["pred"] + b * S})
    cat = {k: np.concatenate([c[k] for c in cols]) if cols else np.zeros(0) for k in
           ("pred", "target", "old", "adv", "weight", "stale", "temp", "exe", "node", "offset")}
    wire = {  # MicroBatch's field order; attention_mask None: kv_end is the structure, no S x S mask
        "input_ids": ids,
        "position_ids": pos,
        "pred_pos": cat["pred"].astype(np.int64),
        "target_ids": cat["target"].astype(np.int64),
        "old_logprobs": cat["old"].astype(np.float32),
        "advantages": cat["adv"].astype(np.float32),
        "weights": cat["weight"].astype(np.float32),
        "staleness": cat["stale"].astype(np.int64),
        "execution_index": cat["exe"].astype(np.int64),
        "temperature": cat["temp"].astype(np.float32),
        # query i sees key j iff j <= i and i lies in the subtree span of j's node
        "kv_end": end,
    }
    routed = _routed_experts(plan, S) if routing else None
    if routed is not None:
        wire["routed_experts"] = routed
    keys = np.stack([cat["exe"], cat["node"], cat["offset"]], axis=1).astype(np.int64)
    return wire, keys


def build_micro_batch(plan: MicroBatchPlan, routing: bool = False) -> tuple[MicroBatch, np.ndarray]:
    """`build_wire` as tensors (a MicroBatch over the same arrays), plus the targets' keys."""
    from gyre.batch import micro_batch_of  # torch: the trainer side and tests, never the head

    wire, keys = build_wire(plan, routing)
    return micro_batch_of(wire), keys


def _routed_experts(plan: MicroBatchPlan, S: int) -> np.ndarray | None:
    """[B, S, L, k] int16 routing of the plan's rows (-1: not recorded, padding), or None."""
    per_row = [row_routing(pieces) for pieces in plan.rows]
    ref = next((r for r in per_row if r is not None), None)
    if ref is None:
        return None
    out = np.full((len(per_row), S, *ref.shape[1:]), -1, np.int16)
    for b, r in enumerate(per_row):
        if r is not None:
            out[b, :len(r)] = r
    return out


# -- the step ----------------------------------------------------------------------------------

@dataclass
class LayoutStats:
    layout: str
    micro_batches: int
    rows: int
    tokens: int               # tokens the forward pass computes (padding excluded)
    padded_tokens: int        # sum of B*S
    unique_tokens: int        # tokens of the union of selected paths: the floor for any layout
    target_tokens: int        # unique selected target tokens (each trained once)
    executions: int
    trajectories: int

    @property
    def tokens_over_unique(self) -> float:
        return self.tokens / self.unique_tokens if self.unique_tokens else 0.0

    def as_dict(self) -> dict:
        return {**self.__dict__, "tokens_over_unique": self.tokens_over_unique}


@dataclass
class Materialized:
    """A step's micro-batches, built lazily so a step never holds all their tensors at once."""

    layout: str
    plans: list[MicroBatchPlan]
    stats: LayoutStats
    routing: bool = False  # carry routed experts (train.routing_replay)

    def __len__(self) -> int:
        return len(self.plans)

    def __getitem__(self, i: int) -> MicroBatch:
        return build_micro_batch(self.plans[i], self.routing)[0]

    def __iter__(self) -> Iterator[MicroBatch]:
        return (self[i] for i in range(len(self)))

    def with_keys(self, i: int) -> tuple[MicroBatch, np.ndarray]:
        return build_micro_batch(self.plans[i], self.routing)

    def wire_with_keys(self, i: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Micro-batch ``i`` as the head sends it (numpy, no torch), with its targets' keys."""
        return build_wire(self.plans[i], self.routing)


def materialize(executions: Sequence[SelectedExecution], *, layout: str = "tree",
                micro_batch_tokens: int = 4096, routing: bool = False) -> Materialized:
    """Micro-batches for ``executions`` (a whole step, or one data-parallel group's share)."""
    plans = plan_micro_batches(executions, layout, micro_batch_tokens)
    stats = LayoutStats(
        layout=layout, micro_batches=len(plans), rows=sum(len(p.rows) for p in plans),
        tokens=sum(p.tokens for p in plans), padded_tokens=sum(p.padded_tokens for p in plans),
        unique_tokens=sum(e.n_tokens for e in executions),
        target_tokens=sum(e.n_targets for e in executions),
        executions=len(executions), trajectories=sum(len(e.leaves) for e in executions),
    )
    return Materialized(layout, plans, stats, routing)
