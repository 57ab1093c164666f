"""Context parallelism for expanded rows: a micro-batch as one packed THD stream, cut over the
ranks of Megatron-Core's context-parallel (CP) group.

The layout is Transformer Engine's (`thd_get_partitioned_indices`, which Megatron-Core's
`get_thd_batch_on_this_cp_rank` calls): the rows are packed back to back, each padded to a
multiple of 2 x cp and cut into 2 x cp equal chunks; CP rank r holds chunks r and 2cp-1-r of every
sequence, so each rank gets one early (cheap) and one late (dear) chunk of causal work. Attention
across the cut is Transformer Engine's (`cp_comm_type`); this module is the index bookkeeping around
it, pure torch: which tokens a rank holds, their positions, which targets it predicts and at which
of its rows, and how the ranks' target log-probs go back to the micro-batch's target order.

Only plain causal rows can be cut. A tree-packed row (`train.layout = "tree"`) lets each subtree
attend to its ancestors wherever they are, a pattern the THD kernels cannot express across the
cut: `pack_rows` refuses such a row and names the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property
from typing import Callable, Sequence

import torch
from torch import Tensor

from gyre.batch import TARGET, MicroBatch

TREE_ROW_FIX = ("a tree row's subtrees attend to keys across the context-parallel cut; set "
                "train.layout = \"expanded\" (plain causal rows) or train.context_parallel = 1")


class NotCausalRowError(ValueError):
    """A row that is not plain causal (a tree-packed row) was given to context parallelism."""


@dataclass(frozen=True)
class PackedRows:
    """The non-empty rows of a micro-batch packed into one THD stream of P slots (P a multiple of
    2 x cp): sequence k occupies slots cu_seqlens_padded[k] .. cu_seqlens_padded[k+1], its real
    tokens first, then padding."""
    cp: int
    rows: Tensor               # [N] long: the micro-batch row of each packed sequence
    cu_seqlens: Tensor         # [N+1] int32: cumulative real lengths (TE's cu_seqlens_q/kv)
    cu_seqlens_padded: Tensor  # [N+1] int32: cumulative padded lengths (TE's *_padded)
    source: Tensor             # [P] long: flat micro-batch index b*S+i of each slot; -1 = padding
    input_ids: Tensor          # [P] long: token ids (padding 0)
    position_ids: Tensor       # [P] long: the row's positions (padding continues them)

    @property
    def num_slots(self) -> int:
        return int(self.source.numel())

    @property
    def max_seqlen(self) -> int:
        """The longest *padded* sequence: RoPE and TE index within each padded sequence."""
        lengths = self.cu_seqlens_padded[1:] - self.cu_seqlens_padded[:-1]
        return int(lengths.max()) if lengths.numel() else 0


def causal_lengths(kv_end: Tensor) -> Tensor:
    """[B] real tokens of each row, or NotCausalRowError for a row that is not plain causal (its
    real keys a prefix 0..L-1 each seen up to the row's end L, padding never)."""
    B, S = kv_end.shape
    idx = torch.arange(S, device=kv_end.device)
    lengths = (kv_end > idx).sum(1)
    expected = torch.where(idx[None, :] < lengths[:, None], lengths[:, None], torch.zeros_like(kv_end))
    bad = (kv_end != expected).any(1).nonzero().view(-1)
    if bad.numel():
        raise NotCausalRowError(f"context parallelism cuts plain causal rows only, and row {int(bad[0])} "
                                f"of this micro-batch is not one (its kv_end is a tree's): {TREE_ROW_FIX}")
    return lengths


def pack_rows(input_ids: Tensor, position_ids: Tensor, kv_end: Tensor, cp: int) -> PackedRows:
    """The rows as one THD stream for `cp` context-parallel ranks (cp = 1: padding only to even)."""
    if cp < 1:
        raise ValueError(f"train.context_parallel must be >= 1, got {cp}")
    B, S = input_ids.shape
    lengths = causal_lengths(kv_end).cpu()
    rows = (lengths > 0).nonzero().view(-1)
    real = lengths[rows]
    padded = (real + 2 * cp - 1) // (2 * cp) * (2 * cp)
    cu = torch.zeros(len(rows) + 1, dtype=torch.int32)
    cu_pad = torch.zeros(len(rows) + 1, dtype=torch.int32)
    cu[1:], cu_pad[1:] = real.cumsum(0), padded.cumsum(0)
    P = int(cu_pad[-1])
    source = torch.full((P,), -1, dtype=torch.long)
    ids = torch.zeros(P, dtype=torch.long)
    pos = torch.zeros(P, dtype=torch.long)
    flat_ids, flat_pos = input_ids.reshape(-1).cpu(), position_ids.reshape(-1).cpu()
    for k, b in enumerate(rows.tolist()):
        start, n, p = int(cu_pad[k]), int(real[k]), int(padded[k])
        src = b * S + torch.arange(n)
        source[start:start + n] = src
        ids[start:start + n] = flat_ids[src]
        pos[start:start + n] = flat_pos[src]
        # padding slots: positions continue the row (finite RoPE angles; no real token sees them)
        pos[start + n:start + p] = flat_pos[src[-1]] + 1 + torch.arange(p - n)
    return PackedRows(cp=cp, rows=rows, cu_seqlens=cu, cu_seqlens_padded=cu_pad, source=source,
                      input_ids=ids, position_ids=pos)


def rank_slots(packed: PackedRows, rank: int) -> Tensor:
    """[P/cp] the stream slots CP rank `rank` holds, in its local order: for every sequence its
    chunk `rank`, then its chunk 2cp-1-rank."""
    return partition_indices(packed.cu_seqlens_padded, packed.cp, rank)


def partition_indices(cu_seqlens_padded: Tensor, cp: int, rank: int) -> Tensor:
    """What Transformer Engine's `thd_get_partitioned_indices(cu_seqlens_padded, total, cp, rank)`
    returns, in torch: the slots of rank `rank`, chunk r then chunk 2cp-1-r of each sequence."""
    if not 0 <= rank < cp:
        raise ValueError(f"context-parallel rank {rank} is outside 0..{cp - 1}")
    parts = []
    for start, end in zip(cu_seqlens_padded[:-1].tolist(), cu_seqlens_padded[1:].tolist()):
        chunk = (end - start) // (2 * cp)
        for j in (rank, 2 * cp - 1 - rank):
            parts.append(torch.arange(start + j * chunk, start + (j + 1) * chunk))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def slot_owner(packed: PackedRows) -> tuple[Tensor, Tensor]:
    """([P] the CP rank holding each slot, [P] its row in that rank's local stream): the inverse
    of `rank_slots`, in closed form (sequence k starts at cu_seqlens_padded[k] / cp on every rank)."""
    cp, cu = packed.cp, packed.cu_seqlens_padded.long()
    slot = torch.arange(packed.num_slots)
    seq = torch.searchsorted(cu, slot, right=True) - 1
    offset = slot - cu[seq]
    chunk = (cu[seq + 1] - cu[seq]) // (2 * cp)
    j = offset // chunk
    rank = torch.where(j < cp, j, 2 * cp - 1 - j)
    local = cu[seq] // cp + torch.where(j < cp, 0, chunk) + offset % chunk
    return rank, local


def target_owners(packed: PackedRows, pred_pos: Tensor, num_positions: int) -> tuple[Tensor, Tensor]:
    """([T] the CP rank of each target, [T] its row in that rank's local stream); `num_positions`
    = B x S of the micro-batch. A target predicted from a padding position is an error."""
    slot_of = torch.full((num_positions,), -1, dtype=torch.long)
    real = packed.source >= 0
    slot_of[packed.source[real]] = torch.arange(packed.num_slots)[real]
    slots = slot_of[pred_pos.cpu()]
    if (slots < 0).any():
        raise ValueError("a target's pred_pos falls on a padding position of its row")
    rank, local = slot_owner(packed)
    return rank[slots], local[slots]


@dataclass(frozen=True)
class RankPlan:
    """Everything context parallelism needs of one micro-batch on one CP rank, built once
    (`plan_micro_batch`) and handed to every consumer (the forward, the loss's target selection,
    the log-prob gather): on a 1M-token row at cp 8 building it takes ~0.2 s, so none rebuilds it."""
    packed: PackedRows
    rank: int
    slots: Tensor          # [n] stream slots it holds (rank_slots)
    input_ids: Tensor      # [1, n] long: THD tokens (Megatron takes [b=1, t])
    position_ids: Tensor   # [1, n] long: their positions
    target_owner: Tensor   # [T] long: the CP rank of each of the micro-batch's targets
    target_index: Tensor   # [t] long: indices into the micro-batch's targets predicted on this rank
    target_rows: Tensor    # [t] long: the local row (0..n-1) of each of those targets' pred_pos
    num_tokens: int        # real (not padding) tokens it holds

    @cached_property
    def rank_targets(self) -> tuple[Tensor, ...]:
        """Every CP rank's target_index, in rank order: only the log-prob gather needs the others'."""
        return tuple(self.target_index if r == self.rank else (self.target_owner == r).nonzero().view(-1)
                     for r in range(self.packed.cp))


def plan_rank(packed: PackedRows, rank: int, pred_pos: Tensor, num_positions: int) -> RankPlan:
    """CP rank `rank`'s part of the packed micro-batch and of its targets (`pred_pos` [T])."""
    slots = rank_slots(packed, rank)
    owner, local = target_owners(packed, pred_pos, num_positions)
    mine = (owner == rank).nonzero().view(-1)
    return RankPlan(packed=packed, rank=rank, slots=slots, input_ids=packed.input_ids[slots][None],
                    position_ids=packed.position_ids[slots][None], target_owner=owner, target_index=mine,
                    target_rows=local[mine], num_tokens=int((packed.source[slots] >= 0).sum()))


def plan_micro_batch(mb: MicroBatch, cp: int, rank: int) -> RankPlan:
    """`plan_rank` of the micro-batch's rows packed for `cp` ranks: the trainer's one call per micro-batch."""
    packed = pack_rows(mb.input_ids, mb.position_ids, mb.kv_end, cp)
    return plan_rank(packed, rank, mb.pred_pos, mb.input_ids.numel())


def scatter_back(num_targets: int, parts: Sequence[tuple[Tensor, Tensor]]) -> Tensor:
    """[T] values in the micro-batch's target order from every rank's (target_index, values);
    every target must come from exactly one rank."""
    if not parts:
        return torch.zeros(num_targets)
    out = parts[0][1].new_zeros(num_targets)
    seen = torch.zeros(num_targets, dtype=torch.long)
    for idx, values in parts:
        idx = idx.to(torch.long).cpu()
        out[idx.to(out.device)] = values
        seen[idx] += 1
    if not bool((seen == 1).all()):
        raise ValueError(f"{int((seen == 0).sum())} targets on no rank, {int((seen > 1).sum())} on "
                         f"several: the ranks' shards do not partition the targets")
    return out


def gather_target_logprobs(local: Tensor, plan: RankPlan, all_gather: Callable[[Tensor], list[Tensor]]) -> Tensor:
    """[T] log-probs in target order from this rank's `local` ones; `all_gather` returns every CP
    rank's (equal-length) tensor in rank order (torch.distributed.all_gather over the CP group).
    The plan knows every rank's target indices (they follow from the micro-batch alone), so only
    the values travel, padded to the longest rank's count."""
    index = plan.rank_targets
    width = max(len(i) for i in index)
    buf = local.new_zeros(width)
    buf[:local.numel()] = local
    gathered = all_gather(buf)
    return scatter_back(int(plan.target_owner.numel()), [(i, g[:len(i)]) for i, g in zip(index, gathered)])


def select_targets(mb: MicroBatch, index: Tensor) -> MicroBatch:
    """The micro-batch with every row field kept and its target fields (pred_pos, target ids,
    weights, ...) restricted to `index`, in that order: what one CP rank's loss sums over."""
    values = {}
    for f in fields(mb):
        v, axis = getattr(mb, f.name), f.metadata.get("axis")
        if axis is None:
            raise TypeError(f"MicroBatch.{f.name} declares no axis: select_targets cannot carry it")
        if axis == TARGET and v is not None:
            v = v[index.to(v.device)]
        values[f.name] = v
    return MicroBatch(**values)
