"""Gated DeltaNet layers on tree-packed rows: the recurrent state forked at branch points.

A micro-batch row is described by ``kv_end`` (gyre.train.tree_attention): token j is seen by
queries j..kv_end[j]-1. A token's *predecessor* on its path is the deepest earlier token that sees
it: i-1 inside a run, the parent node's last token at a branch. `TreeScan` derives, once per
micro-batch (every linear layer reuses it):

* the scan calls: maximal runs of consecutive tokens each continuing the previous one, cut after
  every branch point (a token some later run starts from), so a call's final state is exactly the
  state a child needs. Calls run in position order (depth-first order of the tree), a child
  starting from its parent's final state; an unbranched path is one call. Autograd sums the
  gradients of a state used by several children.
* for the short causal convolution, each token's K-1 predecessors on its path (its conv window),
  so the window is forked with the state and the convolution is one gather for the whole row.

Expanded rows are the special case of one run per row; padding (kv_end <= position) is skipped.
Every real token is computed exactly once: the tree's unique tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gyre.model.gated_deltanet import chunk_gated_delta_rule, gated_rms_norm, gdn_gates, split_fused_qkvz
from gyre.model.spec import ModelSpec


@dataclass
class _Call:
    row: int
    start: int
    end: int
    parent: int  # position whose final state this call starts from (-1: zeros)


@dataclass
class TreeScan:
    """The scan plan of one micro-batch; build with `TreeScan.build`."""

    calls: list[_Call]
    pred: Tensor   # [B, S] long: each token's predecessor on its path (-1: none or padding)
    real: Tensor   # [B, S] bool

    @classmethod
    def build(cls, kv_end: Tensor) -> "TreeScan":
        kv = kv_end.detach().long().cpu()
        B, S = kv.shape
        pos = torch.arange(S)
        real = kv > pos
        # a run continues where the previous token sees this one
        cont = torch.zeros(B, S, dtype=torch.bool)
        cont[:, 1:] = real[:, 1:] & (kv[:, :-1] > pos[1:])
        pred = torch.where(cont, pos - 1, torch.full_like(pos, -1))
        calls: list[_Call] = []
        for b in range(B):
            ends = kv[b].tolist()
            starts = torch.nonzero(real[b] & ~cont[b]).view(-1).tolist()
            cut = set(starts)
            stack: list[int] = []  # run starts whose subtree is still open
            for s in starts:
                while stack and ends[stack[-1]] <= s:
                    stack.pop()
                if stack:  # the deepest token of the open run that sees s (ends never grow along a run)
                    lo, hi = stack[-1], s - 1
                    while lo < hi:
                        mid = (lo + hi + 1) // 2
                        lo, hi = (mid, hi) if ends[mid] > s else (lo, mid - 1)
                    pred[b, s] = lo
                    cut.add(lo + 1)  # so the parent's state is a call's final state
                stack.append(s)
            bounds = sorted(cut)
            stop = int(real[b].sum())
            if not bool(real[b, :stop].all()):
                raise ValueError(f"row {b}: padding inside the row; tree rows hold their tokens first")
            for i, st in enumerate(bounds):
                en = bounds[i + 1] if i + 1 < len(bounds) else stop
                calls.append(_Call(b, st, en, int(pred[b, st])))
        return cls(calls, pred.to(kv_end.device), real.to(kv_end.device))

    @property
    def tokens(self) -> int:
        """Tokens scanned (each real token once)."""
        return sum(c.end - c.start for c in self.calls)

    def window(self, kernel: int) -> Tensor:
        """[B, S, kernel] positions of each token's conv window, oldest first (-1: zero)."""
        cols = [torch.arange(self.pred.shape[1], device=self.pred.device).expand_as(self.pred)]
        cols[0] = torch.where(self.real, cols[0], torch.full_like(cols[0], -1))
        for _ in range(kernel - 1):
            prev = cols[-1]
            cols.append(torch.where(prev >= 0, self.pred.gather(1, prev.clamp_min(0)), prev))
        return torch.stack(cols[::-1], dim=-1)

    def conv(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        """SiLU of the depthwise causal convolution of x ``[B, S, C]`` (weight ``[C, 1, K]``) along
        each token's path."""
        B, S, C = x.shape
        K = weight.shape[-1]
        win = self.window(K)                                        # [B, S, K]
        padded = torch.cat([x.new_zeros(B, 1, C), x], dim=1)         # index 0: zero
        idx = (win + 1).view(B, S * K, 1).expand(B, S * K, C)
        taps = padded.gather(1, idx).view(B, S, K, C)
        out = torch.einsum("bskc,ck->bsc", taps, weight[:, 0].to(x.dtype))
        return F.silu(out if bias is None else out + bias.to(x.dtype))

    def scan(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
             kernel=chunk_gated_delta_rule) -> Tensor:
        """The gated delta rule over every call, children from their parents' final states.
        Shapes as `chunk_gated_delta_rule` with the whole micro-batch; padding outputs are 0.
        `kernel(q, k, v, g, beta, initial_state) -> (out, final state)`: Gyre's, or another
        backend's (gyre.train.megatron_gdn)."""
        out = v.new_zeros(v.shape)
        states: dict[tuple[int, int], Tensor] = {}
        for c in self.calls:
            init = states.get((c.row, c.parent)) if c.parent >= 0 else None
            sl = (slice(c.row, c.row + 1), slice(c.start, c.end))
            o, final = kernel(q[sl], k[sl], v[sl], g[sl], beta[sl], init)
            out = out.index_put((torch.tensor([c.row]), torch.arange(c.start, c.end, device=v.device)), o[0])
            states[(c.row, c.end - 1)] = final
        return out


class _Conv(nn.Module):
    """Holds the depthwise conv weight under transformers' name (``conv1d.weight``)."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))


class _Gain(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))


class GatedDeltaNet(nn.Module):
    """transformers' Qwen3-Next / Qwen3.5 GatedDeltaNet, with the scan following a `TreeScan`."""

    def __init__(self, spec: ModelSpec) -> None:
        from gyre.train.qwen2 import Linear

        super().__init__()
        s = self.spec = spec
        h, key, value = spec.hidden, spec.lin_k_heads * spec.lin_k_dim, spec.lin_v_heads * spec.lin_v_dim
        self.fused = spec.family.gdn_fused_proj
        if self.fused:
            self.in_proj_qkvz = Linear(h, 2 * key + 2 * value, bias=False)
            self.in_proj_ba = Linear(h, 2 * s.lin_v_heads, bias=False)
        else:
            self.in_proj_qkv = Linear(h, 2 * key + value, bias=False)
            self.in_proj_z = Linear(h, value, bias=False)
            self.in_proj_b = Linear(h, s.lin_v_heads, bias=False)
            self.in_proj_a = Linear(h, s.lin_v_heads, bias=False)
        self.conv1d = _Conv(spec.conv_dim, spec.conv_kernel)
        self.dt_bias = nn.Parameter(torch.ones(s.lin_v_heads))
        self.A_log = nn.Parameter(torch.zeros(s.lin_v_heads))
        self.norm = _Gain(s.lin_v_dim)
        self.out_proj = Linear(value, h, bias=False)

    def forward(self, x: Tensor, tree: TreeScan) -> Tensor:
        s = self.spec
        B, S, _ = x.shape
        key = s.lin_k_heads * s.lin_k_dim
        if self.fused:
            q, k, v, z, b, a = split_fused_qkvz(self.in_proj_qkvz(x), self.in_proj_ba(x), s.lin_k_heads,
                                                s.lin_k_dim, s.lin_v_heads, s.lin_v_dim)
            mixed = torch.cat([q, k, v.reshape(B, S, -1)], dim=-1)
        else:
            mixed = self.in_proj_qkv(x)
            z = self.in_proj_z(x).view(B, S, s.lin_v_heads, s.lin_v_dim)
            b, a = self.in_proj_b(x), self.in_proj_a(x)
        mixed = tree.conv(mixed, self.conv1d.weight)
        q, k, v = torch.split(mixed, [key, key, s.lin_v_heads * s.lin_v_dim], dim=-1)
        g, beta = gdn_gates(a, b, self.A_log, self.dt_bias)
        out = tree.scan(q.view(B, S, s.lin_k_heads, s.lin_k_dim), k.view(B, S, s.lin_k_heads, s.lin_k_dim),
                        v.view(B, S, s.lin_v_heads, s.lin_v_dim), g, beta)
        out = gated_rms_norm(out, z, self.norm.weight, s.eps)
        return self.out_proj(out.reshape(B, S, -1))
