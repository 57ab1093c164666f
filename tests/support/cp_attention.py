"""A CPU stand-in for Transformer Engine's core attention under context parallelism (tests only).

Megatron-Core runs context parallelism through TEDotProductAttention (CUDA kernels; its local
DotProductAttention refuses context_parallel_size > 1). This module takes the same constructor and
forward arguments and computes the same result the simple way: each rank all-gathers the keys
and values of its CP group (differentiable: the backward sums the key/value gradients back to
their owners), puts them in stream order with `gyre.train.context_parallel.partition_indices`,
and attends its own queries causally within each packed sequence, padding never seen. It lets
the trainer's CP wiring (THD stream, PackedSeqParams, Megatron's THD RoPE, target rows, DDP's sum
over the CP group) run end to end on gloo ranks.
"""

from __future__ import annotations

import torch
import torch.distributed.nn.functional as dist_nn

from gyre.train.context_parallel import partition_indices


class AllGatherCPAttention(torch.nn.Module):
    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        self.config = config
        self.group = pg_collection.cp
        head_dim = k_channels or config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else head_dim ** -0.5

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        p = packed_seq_params
        if p is None or p.qkv_format != "thd" or attention_mask is not None:
            raise ValueError("the CP stand-in takes packed THD input (PackedSeqParams) and no mask")
        cp, rank = self.group.size(), self.group.rank()
        cu_pad, cu = p.cu_seqlens_q_padded.long().cpu(), p.cu_seqlens_q.long().cpu()
        P = int(cu_pad[-1])
        order = torch.cat([partition_indices(cu_pad, cp, r) for r in range(cp)])

        def whole(x):  # [t, h, d] of this rank -> [P, h, d] of the whole stream, in stream order
            parts = dist_nn.all_gather(x.contiguous(), group=self.group)
            return x.new_zeros((P,) + tuple(x.shape[1:])).index_copy(0, order.to(x.device), torch.cat(parts))

        k, v = whole(key), whole(value)
        slot = torch.arange(P)
        seq = torch.searchsorted(cu_pad, slot, right=True) - 1
        real = slot - cu_pad[seq] < cu[seq + 1] - cu[seq]
        mine = partition_indices(cu_pad, cp, rank)
        allowed = (seq[mine][:, None] == seq[None, :]) & (slot[None, :] <= mine[:, None]) & real[None, :]
        rep = query.shape[1] // k.shape[1]  # grouped-query attention
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = torch.einsum("qhd,khd->hqk", query.float(), k.float()) * self.scale
        scores = scores.masked_fill(~allowed.to(scores.device)[None], float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(query.dtype)
        return out.reshape(out.shape[0], -1)
