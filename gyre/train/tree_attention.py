"""Attention whose work follows the tree, not the padded S x S square.

A micro-batch row (tree-packed or expanded) is described by one number per key:
``kv_end[b, j]`` = the end of the subtree span of key j's node, so that

    query i sees key j  <=>  j <= i < kv_end[b, j]        (padding keys: kv_end = 0)

This is exactly the dense mask the materializer builds (ancestry + causal), in O(S) numbers.
`TreeMask` turns it into what the attention kernels need, once per micro-batch, and every layer
reuses it:

* CUDA: a FlexAttention `BlockMask` (torch.nn.attention.flex_attention) built from the same
  predicate as a `mask_mod`; the compiled kernel skips key blocks no query of a block can see.
  Unchecked here (no GPU on the development machine); the mask_mod itself is checked on the CPU
  by running FlexAttention's eager forward in tests.
* CPU: FlexAttention in torch 2.13 has no CPU backward, so an exact block-sparse path: the row is
  cut into blocks of `block` tokens; query block q needs key block k (k <= q) iff some key of k
  has kv_end > q's first position, so each key block is needed by one contiguous run of query
  blocks. Consecutive query blocks are grouped into chunks of at most `CHUNK_QUERIES` queries
  and about `CHUNK_PAIRS` (query, key) pairs (large: the kernel tiles them itself); a chunk
  gathers the key blocks it needs and splits them in two: blocks every query of the chunk sees
  whole (at xLong lengths ~99% of them) run torch's CPU flash kernel with no mask at all, the
  rest (the diagonal, subtrees that end inside the chunk) run it under an additive mask built
  from `kv_end`; the two softmaxes merge by their log-sum-exps.
  Backward runs the kernel's own backward per part with the saved output and LSE (no forward
  recompute; `_ChunkedAttention`), and `train.recompute` keeps the kernel's outputs
  (`keep_attention_on_recompute`), so each pass holds one chunk at a time: memory O(S x block)
  plus one chunk, work the tree's ancestor pairs at block granularity instead of S^2, each pair
  computed once forward and once backward.

Padding queries see only themselves (never NaN); no target reads them and no real query sees
them, so loss and gradients equal the dense path's. Written here rather than taken from a
library because no maintained CPU block-sparse attention with autograd exists for torch 2.13.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import create_selective_checkpoint_contexts


DEFAULT_BLOCK = 128       # CPU: at xLong lengths 99% of key blocks are then fully visible (no mask)
FLEX_BLOCK = 128          # CUDA: FlexAttention's tile size
CHUNK_PAIRS = 1 << 28    # CPU: (query, key) pairs of one chunk: the flash kernel never holds them
CHUNK_QUERIES = 1024     # CPU: queries of one chunk (bounds its mask: queries x partly visible keys)


def kv_end_from_mask(attention_mask: Tensor) -> Tensor | None:
    """`kv_end` of a dense [B,1,S,S] bool mask (True = masked) if the mask has the tree form
    (each key visible to one contiguous run of queries starting at itself), else None."""
    allowed = ~attention_mask[:, 0]                    # [B, Sq, Sk]
    B, S, _ = allowed.shape
    end = allowed.sum(dim=1) + torch.arange(S, device=allowed.device)  # candidate end per key
    seen = allowed.any(dim=1)
    end = torch.where(seen, end, torch.zeros_like(end))
    i = torch.arange(S, device=allowed.device)
    rebuilt = (i[None, :] <= i[:, None])[None] & (i[None, :, None] < end[:, None, :])
    return end if torch.equal(rebuilt, allowed) else None


@dataclass
class _Chunk:
    row: int           # b
    q0: int            # first query block of the chunk (in the row)
    q1: int            # one past the last
    kv_blocks: Tensor  # [m] ascending key blocks that some query of [q0, q1) sees
    full: Tensor       # [m] bool: every query of the chunk sees every key of that block (no mask)


@dataclass
class TreeMask:
    """The attention structure of one micro-batch; build with `TreeMask.build`."""

    kv_end: Tensor                 # [B, S] long
    block: int
    n_blocks: int = 0
    chunks: list[_Chunk] = field(default_factory=list)
    flex: object = None            # a FlexAttention BlockMask (CUDA)
    pairs: int = 0                 # block-level (query, key) token pairs computed (CPU path)

    @classmethod
    def build(cls, kv_end: Tensor, *, block: int | None = None, use_flex: bool | None = None,
              chunk_pairs: int = CHUNK_PAIRS) -> "TreeMask":
        kv_end = kv_end.long()
        if use_flex is None:
            use_flex = kv_end.is_cuda
        if use_flex:
            return cls(kv_end, block or FLEX_BLOCK, flex=_flex_block_mask(kv_end, block or FLEX_BLOCK))
        mask = cls(kv_end, block or DEFAULT_BLOCK)
        mask._plan_chunks(chunk_pairs)
        return mask

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.kv_end.shape)

    # --- CPU plan -----------------------------------------------------------------------------
    def _plan_chunks(self, chunk_pairs: int) -> None:
        """Cut each row into runs of query blocks whose pairs (queries x keys they need) stay near
        `chunk_pairs` and whose queries stay within `CHUNK_QUERIES`. O(S) numbers per row are
        kept, never S x S."""
        B, S = self.kv_end.shape
        blk = self.block
        nb = max(1, -(-S // blk))
        end = F.pad(self.kv_end, (0, nb * blk - S)).view(B, nb, blk).cpu()
        real = (end > torch.arange(nb * blk).view(nb, blk)).any(-1)            # [B, nb]
        first_end = end.amin(-1)  # a key block is seen whole by queries [its end, first_end)
        # key block k is seen by query blocks k .. last[k] (a key's queries are one contiguous run)
        last = torch.where(real, (end.amax(-1) - 1) // blk, torch.full_like(real, -1, dtype=torch.long))
        self.n_blocks, self.chunks, self.pairs = nb, [], 0
        for b in range(B):
            lb, rb = last[b], real[b]
            q0 = 0
            while q0 < nb:
                if not rb[q0]:  # an all-padding query block: nothing reads it
                    q0 += 1
                    continue
                # keys needed by queries [q0, q1): k < q1 with last[k] >= q0; grow q1 while the
                # chunk fits (at least one block)
                seen = torch.cumsum((lb >= q0).long(), 0)                      # [nb]: keys < k+1
                q1 = q0 + 1
                while q1 < nb and rb[q1] and (q1 + 1 - q0) * int(seen[q1]) * blk * blk <= chunk_pairs \
                        and (q1 + 1 - q0) * blk <= CHUNK_QUERIES:
                    q1 += 1
                kv = torch.nonzero(lb[:q1] >= q0).view(-1)
                full = (kv < q0) & (first_end[b, kv] >= q1 * blk)
                self.chunks.append(_Chunk(b, q0, q1, kv, full))
                self.pairs += (q1 - q0) * blk * len(kv) * blk
                q0 = q1

    # --- attention ----------------------------------------------------------------------------
    def attend(self, query: Tensor, key: Tensor, value: Tensor, scale: float) -> Tensor:
        """query [B,H,S,D], key/value [B,Hkv,S,D] -> [B,H,S,D]; H a multiple of Hkv."""
        if self.flex is not None:
            q, k, v = (x.contiguous() for x in (query, key, value))  # Megatron hands permuted views
            # a training row is never decoding: under 128 queries FlexAttention would pick its
            # flex_decoding kernel, which had no kernel choice for these shapes on an H200 (torch 2.11)
            return _flex_attention()(q, k, v, block_mask=self.flex, scale=scale,
                                     enable_gqa=q.shape[1] != k.shape[1],
                                     kernel_options={"FORCE_USE_FLEX_ATTENTION": True})
        B, H, S, D = query.shape
        if (B, S) != tuple(self.kv_end.shape):
            raise ValueError(f"tree mask is for {tuple(self.kv_end.shape)}, attention got {(B, S)}")
        pad = self.n_blocks * self.block - S
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
        end = F.pad(self.kv_end, (0, pad)).to(query.device)
        return _ChunkedAttention.apply(q, k, v, end, self, scale)[:, :, :S]


class _ChunkedAttention(torch.autograd.Function):
    """Attention over a `TreeMask`'s chunks, flash-attention style. Each chunk runs torch's CPU
    flash kernel twice: over its fully visible key blocks without any mask, and over the partly
    visible ones (the diagonal, subtree edges) under a mask built from `kv_end`; the two partial
    softmaxes merge by their log-sum-exps. Forward keeps q, k, v, the output and the LSE (O(S));
    backward runs the kernel's own backward per part with the merged output and LSE (exact:
    softmax rows are normalized by the merged LSE), so no pass holds more than one chunk's
    scores and the forward is never recomputed."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, end: Tensor, plan: "TreeMask", scale: float) -> Tensor:
        out = q.new_zeros(q.shape)  # all-padding query blocks stay zero: nothing reads them
        lse = q.new_zeros(q.shape[:3])
        for c in plan.chunks:
            sl = slice(c.q0 * plan.block, c.q1 * plan.block)
            o, l = _merge([_flash(q[c.row, :, sl], kc, vc, m, scale)
                           for _, kc, vc, m in _parts(c, k, v, end, plan.block)])
            out[c.row, :, sl], lse[c.row, :, sl] = o, l
        ctx.save_for_backward(q, k, v, end, out, lse)
        ctx.plan, ctx.scale = plan, scale
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, end, out, lse = ctx.saved_tensors
        plan, blk = ctx.plan, ctx.plan.block
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        rep = q.shape[1] // k.shape[1]
        for c in plan.chunks:
            sl = slice(c.q0 * blk, c.q1 * blk)
            qc, go, oc, lc = (x[c.row, :, sl][None] for x in (q, grad_out, out, lse))
            for kpos, kc, vc, mask in _parts(c, k, v, end, blk):
                gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    go, qc, _heads(kc, rep), _heads(vc, rep), oc, lc, 0.0, False, attn_mask=mask,
                    scale=ctx.scale)
                dq[c.row, :, sl] += gq[0]
                dk[c.row].index_add_(1, kpos, _fold(gk[0], rep))
                dv[c.row].index_add_(1, kpos, _fold(gv[0], rep))
        return dq, dk, dv, None, None, None


def _parts(c: _Chunk, k: Tensor, v: Tensor, end: Tensor, blk: int):
    """(key positions, keys [Hkv, n, D], values, additive mask or None) of the chunk's fully
    visible key blocks (no mask), then of its partly visible ones (mask from `kv_end`); a part
    without blocks is left out."""
    dev = end.device
    qpos = torch.arange(c.q0 * blk, c.q1 * blk, device=dev)
    ar = torch.arange(blk, device=dev)
    for full in (True, False):
        blocks = c.kv_blocks[c.full if full else ~c.full].to(dev)
        if not len(blocks):
            continue
        kpos = (blocks[:, None] * blk + ar).view(-1)
        mask = None
        if not full:
            mask = _visible_mask(qpos, kpos, end[c.row, kpos], k.dtype)
        yield kpos, k[c.row].index_select(1, kpos), v[c.row].index_select(1, kpos), mask


_MASKED = -1e30


def _visible_mask(qpos: Tensor, kpos: Tensor, kend: Tensor, dtype) -> Tensor:
    """Additive mask [queries, keys]: 0 where query i sees key j (j <= i < kend[j], or i == j so
    a padding query sees itself), else a large finite negative (not -inf: a row that sees nothing
    in this part gets weight exp(-1e30 - lse) = 0 when the parts merge, never NaN).
    Written as |2(i - j) - (span - 1)| < span with span = max(kend - j, 1): four passes over the
    scores, all but one in place (this mask is a large part of the CPU path's work)."""
    # every number below is an integer under 2 * (last query + 1) (keys <= queries here): exact
    exact = torch.float32 if 2 * (int(qpos[-1]) + 1) + int(kend.max()) < 1 << 24 else torch.float64
    span = (kend - kpos).clamp_(min=1).to(exact)
    mid = (2 * kpos).to(exact) + span - 1
    t = (2 * qpos).to(exact)[:, None] - mid[None, :]
    return t.abs_().ge_(span).mul_(max(_MASKED, torch.finfo(dtype).min)).to(dtype)


def _heads(x: Tensor, rep: int) -> Tensor:
    """[Hkv, n, D] -> [1, H, n, D]: each KV head repeated for its `rep` query heads."""
    return (x.repeat_interleave(rep, 0) if rep > 1 else x)[None]


def _fold(g: Tensor, rep: int) -> Tensor:
    """[H, n, D] gradients of repeated KV heads -> [Hkv, n, D] (the sum over each group)."""
    return g.view(-1, rep, *g.shape[1:]).sum(1) if rep > 1 else g


def _flash(qc: Tensor, kc: Tensor, vc: Tensor, mask: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """qc [H, Cq, D] against kc/vc [Hkv, n, D]: (output [H, Cq, D], log-sum-exp [H, Cq])."""
    rep = qc.shape[0] // kc.shape[0]
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qc[None], _heads(kc, rep), _heads(vc, rep), attn_mask=mask, scale=scale)
    return o[0], lse[0]


def _merge(parts: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """One softmax from softmaxes over disjoint key sets: weights exp(lse_i - lse)."""
    if len(parts) == 1:
        return parts[0]
    (o1, l1), (o2, l2) = parts
    lse = torch.logaddexp(l1, l2)
    return o1 * (l1 - lse).exp()[..., None] + o2 * (l2 - lse).exp()[..., None], lse


def keep_attention_on_recompute():
    """`context_fn` for torch.utils.checkpoint: a recomputed layer reuses the CPU flash kernel's
    forward outputs (O(S) per layer: [H, S, D] and the LSE) instead of running it again, the
    path's largest cost; everything else in the layer is recomputed as before."""
    return create_selective_checkpoint_contexts(
        [torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default])


# --- FlexAttention (CUDA) ------------------------------------------------------------------------

def tree_mask_mod(kv_end: Tensor):
    """The FlexAttention mask_mod of `kv_end`: query q sees key kv iff kv <= q < kv_end[b, kv]."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < kv_end[b, kv_idx])

    return mask_mod


@functools.lru_cache(maxsize=None)
def _compiled_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


def _flex_block_mask(kv_end: Tensor, block: int):
    """Compiled on CUDA, as torch's docs advise for long rows: eager, create_block_mask materializes
    the whole S x S mask first (92 GiB for the 314,654-token case-study row on an H200: out of memory)."""
    from torch.nn.attention.flex_attention import create_block_mask

    make = _compiled_create_block_mask() if kv_end.is_cuda else create_block_mask
    B, S = kv_end.shape
    return make(tree_mask_mod(kv_end), B, None, S, S, device=kv_end.device, BLOCK_SIZE=block)


_FLEX = None


def _flex_attention():
    """flex_attention compiled once per process (uncompiled it materializes the S x S scores)."""
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention) if torch.cuda.is_available() else flex_attention
    return _FLEX


# --- the attention the embedded trainer's model calls ---------------------------------------------

def attention(query: Tensor, key: Tensor, value: Tensor, mask, scale: float) -> Tensor:
    """query [B,H,S,D], key/value [B,Hkv,S,D] -> [B,H,S,D]. `mask`: a TreeMask runs the tree
    path; a bool [B,1,S,S] mask (True = masked) or None (causal) runs transformers' eager
    attention, except that masked scores are set to the dtype's minimum instead of having it added
    (the same softmax); a padding query that sees nothing gets a uniform row, not NaN, and no
    target reads it."""
    if isinstance(mask, TreeMask):
        return mask.attend(query, key, value, scale)
    rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    weights = torch.matmul(query, key.transpose(2, 3)) * scale
    if mask is None:
        S = query.shape[2]
        mask = torch.ones(S, S, dtype=torch.bool, device=query.device).triu(1)
    weights = weights.masked_fill(mask, torch.finfo(weights.dtype).min)
    weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value)
