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
  has kv_end > q's first position. Query blocks with the same number of needed key blocks are
  batched: their key/value blocks are gathered and one `scaled_dot_product_attention` call with
  the element mask runs per batch. Work is sum over query blocks of needed key blocks, i.e. the
  tree's ancestor pairs at block granularity, instead of S^2.

Padding queries see only themselves (never NaN); no target reads them and no real query sees
them, so loss and gradients equal the dense path's. Written here rather than taken from a
library because no maintained CPU block-sparse attention with autograd exists for torch 2.13.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from gyre.batch import mask_from_kv_end

DEFAULT_BLOCK = 64        # CPU: small blocks follow short tree nodes closely
FLEX_BLOCK = 128          # CUDA: FlexAttention's tile size


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


def dense_mask(kv_end: Tensor) -> Tensor:
    """[B,1,S,S] bool mask (True = masked) of `kv_end`: what the dense path attends through."""
    return mask_from_kv_end(kv_end)


@dataclass
class _Group:
    q_blocks: Tensor   # [n] flat query block index b * n_blocks + qb
    kv_blocks: Tensor  # [n, m] flat key block indices (same row)
    allowed: Tensor    # [n, 1, block, m * block] bool, True = visible


@dataclass
class TreeMask:
    """The attention structure of one micro-batch; build with `TreeMask.build`."""

    kv_end: Tensor                 # [B, S] long
    block: int
    n_blocks: int = 0
    groups: list[_Group] = field(default_factory=list)
    flex: object = None            # a FlexAttention BlockMask (CUDA)
    pairs: int = 0                 # block-level (query, key) token pairs computed (CPU path)

    @classmethod
    def build(cls, kv_end: Tensor, *, block: int | None = None, use_flex: bool | None = None
              ) -> "TreeMask":
        kv_end = kv_end.long()
        if use_flex is None:
            use_flex = kv_end.is_cuda
        if use_flex:
            return cls(kv_end, block or FLEX_BLOCK, flex=_flex_block_mask(kv_end, block or FLEX_BLOCK))
        mask = cls(kv_end, block or DEFAULT_BLOCK)
        mask._plan_blocks()
        return mask

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.kv_end.shape)

    # --- CPU block plan ---------------------------------------------------------------------
    def _plan_blocks(self) -> None:
        B, S = self.kv_end.shape
        blk = self.block
        nb = max(1, -(-S // blk))
        Sp = nb * blk
        dev = self.kv_end.device
        end = F.pad(self.kv_end, (0, Sp - S))                       # padding keys: end 0
        pos = torch.arange(Sp, device=dev)
        real = end > pos                                            # [B, Sp] real tokens
        blk_end = end.view(B, nb, blk).amax(-1)                     # [B, nb] max end per key block
        blk_real = real.view(B, nb, blk).any(-1)                    # [B, nb]
        qb = torch.arange(nb, device=dev)
        # key block k < q is needed iff one of its keys is seen by q's first query
        need = (qb[None, None, :] < qb[None, :, None]) & (blk_end[:, None, :] > (qb * blk)[None, :, None])
        need |= torch.eye(nb, dtype=torch.bool, device=dev)[None]   # the diagonal block
        need &= blk_real[:, :, None]                                # all-padding query blocks: skip
        counts = need.sum(-1).view(-1)                              # [B*nb]
        flat_need = need.view(B * nb, nb)
        end_flat = end.view(B * nb, blk)
        self.n_blocks, self.groups, self.pairs = nb, [], 0
        for m in torch.unique(counts).tolist():
            if m == 0:
                continue
            q = torch.nonzero(counts == m).view(-1)                 # [n]
            rows = q // nb
            kb = torch.nonzero(flat_need[q])[:, 1].view(len(q), m)  # ascending key blocks
            kv = rows[:, None] * nb + kb                            # [n, m]
            qpos = (q % nb)[:, None] * blk + torch.arange(blk, device=dev)         # [n, blk]
            kpos = (kb[:, :, None] * blk + torch.arange(blk, device=dev)).view(len(q), m * blk)
            kend = end_flat[kv].view(len(q), m * blk)
            allowed = ((kpos[:, None, :] <= qpos[:, :, None]) & (qpos[:, :, None] < kend[:, None, :])) \
                | (kpos[:, None, :] == qpos[:, :, None])            # padding queries see themselves
            self.groups.append(_Group(q, kv, allowed[:, None]))
            self.pairs += len(q) * blk * m * blk

    # --- attention ----------------------------------------------------------------------------
    def attend(self, query: Tensor, key: Tensor, value: Tensor, scale: float) -> Tensor:
        """query [B,H,S,D], key/value [B,Hkv,S,D] -> [B,H,S,D]; H a multiple of Hkv."""
        if self.flex is not None:
            q, k, v = (x.contiguous() for x in (query, key, value))  # Megatron hands permuted views
            return _flex_attention()(q, k, v, block_mask=self.flex, scale=scale,
                                     enable_gqa=q.shape[1] != k.shape[1])
        B, H, S, D = query.shape
        Hkv = key.shape[1]
        if (B, S) != tuple(self.kv_end.shape):
            raise ValueError(f"tree mask is for {tuple(self.kv_end.shape)}, attention got {(B, S)}")
        blk, nb = self.block, self.n_blocks
        pad = nb * blk - S

        def blocks(x: Tensor, heads: int) -> Tensor:  # [B,h,S,D] -> [B*nb, h, blk, D]
            x = F.pad(x, (0, 0, 0, pad))
            return x.view(B, heads, nb, blk, D).permute(0, 2, 1, 3, 4).reshape(B * nb, heads, blk, D)

        qb, kb, vb = blocks(query, H), blocks(key, Hkv), blocks(value, Hkv)
        rep = H // Hkv
        outs, idx = [], []
        for g in self.groups:
            n, m = g.kv_blocks.shape
            k = kb[g.kv_blocks].transpose(1, 2).reshape(n, Hkv, m * blk, D)
            v = vb[g.kv_blocks].transpose(1, 2).reshape(n, Hkv, m * blk, D)
            if rep > 1:
                k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            outs.append(F.scaled_dot_product_attention(qb[g.q_blocks], k, v, attn_mask=g.allowed,
                                                       scale=scale))
            idx.append(g.q_blocks)
        out = query.new_zeros(B * nb, H, blk, D)
        if outs:
            out = out.index_copy(0, torch.cat(idx), torch.cat(outs))
        out = out.view(B, nb, H, blk, D).permute(0, 2, 1, 3, 4).reshape(B, H, nb * blk, D)
        return out[:, :, :S]


# --- FlexAttention (CUDA) ------------------------------------------------------------------------

def tree_mask_mod(kv_end: Tensor):
    """The FlexAttention mask_mod of `kv_end`: query q sees key kv iff kv <= q < kv_end[b, kv]."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < kv_end[b, kv_idx])

    return mask_mod


def _flex_block_mask(kv_end: Tensor, block: int):
    from torch.nn.attention.flex_attention import create_block_mask

    B, S = kv_end.shape
    return create_block_mask(tree_mask_mod(kv_end), B, None, S, S, device=kv_end.device,
                             BLOCK_SIZE=block)


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
