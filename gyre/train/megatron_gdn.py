"""Megatron-Core's Gated DeltaNet layer with the recurrent state in and out (issue 30 item 4).

Megatron-Core 0.16.1's ``megatron.core.ssm.gated_delta_net.GatedDeltaNet.forward`` calls its
kernel with ``initial_state=None`` and refuses packed sequences, so a tree-packed row cannot run
through it. `tree_forward` is that forward, op for op and on the layer's own parameters
(``in_proj``, ``conv1d``, ``A_log``, ``dt_bias``, ``out_norm``, ``out_proj``), with the scan
following a `TreeScan`: every node one kernel call from its parent's final state, the conv window
forked the same way. The kernel is flash-linear-attention's ``chunk_gated_delta_rule`` (what
Megatron uses on CUDA; it takes ``initial_state`` and returns the final state with gradients for
both) or, without it, Megatron's own torch fallback ``torch_chunk_gated_delta_rule`` (the same
arguments). Sequence parallel and tensor parallel > 1 are not handled here (the split of q/k/v/z/b/a
per TP rank would follow Megatron's in_proj layout).

Checked on the CPU against Gyre's module through the torch fallback (tests/train/test_hybrid.py); the
CUDA kernel path is in benchmarks/gpu_check.sh.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.ssm import gated_delta_net as mgdn
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from gyre.model.gated_deltanet import l2norm
from gyre.train.gated_deltanet import TreeScan


def kernel(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None
           ) -> tuple[Tensor, Tensor]:
    """Megatron's chunked gated delta rule with a state in and out (q, k already L2-normalised
    and repeated to the value heads, as Megatron's forward hands them over)."""
    fla = mgdn.chunk_gated_delta_rule
    fn = fla if fla is not None and q.is_cuda else mgdn.torch_chunk_gated_delta_rule
    return fn(q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=True,
              use_qk_l2norm_in_kernel=False)


def tree_forward(layer, hidden_states: Tensor, tree: TreeScan) -> tuple[Tensor, Tensor | None]:
    """`layer` (a Megatron ``GatedDeltaNet``) on ``hidden_states`` ``[s, b, h]`` (Megatron's
    layout) whose rows `tree` describes; returns ``(out [s, b, h], out_bias)`` as its forward."""
    if layer.tp_size != 1 or layer.sp_size != 1:
        raise NotImplementedError("tree_forward: tensor/sequence parallel GDN layers are not wrapped yet")
    S, B, _ = hidden_states.shape
    qkvzba, _ = layer.in_proj(hidden_states)
    qkvzba = qkvzba.transpose(0, 1)                                            # [b, s, x]
    qkv, gate, beta, alpha = torch.split(
        qkvzba, [layer.qk_dim * 2 + layer.v_dim, layer.v_dim, layer.num_value_heads, layer.num_value_heads], dim=-1)
    gate = gate.reshape(B, S, -1, layer.value_head_dim)
    if layer.activation not in ("silu", "swish"):
        raise NotImplementedError(f"tree_forward: conv activation {layer.activation!r} (GDN uses silu)")
    qkv = tree.conv(qkv, layer.conv1d.weight, layer.conv1d.bias)               # forked conv windows
    query, key, value = torch.split(qkv, [layer.qk_dim, layer.qk_dim, layer.v_dim], dim=-1)
    query = query.reshape(B, S, -1, layer.key_head_dim)
    key = key.reshape(B, S, -1, layer.key_head_dim)
    value = value.reshape(B, S, -1, layer.value_head_dim)
    if layer.use_qk_l2norm:
        query, key = l2norm(query), l2norm(key)
    rep = layer.num_value_heads // layer.num_key_heads
    if rep > 1:
        query, key = query.repeat_interleave(rep, dim=2), key.repeat_interleave(rep, dim=2)
    g = -layer.A_log.exp() * F.softplus(alpha.float() + layer.dt_bias)
    out = tree.scan(query.contiguous(), key.contiguous(), value.contiguous(), g, beta.sigmoid(), kernel=kernel)
    out = layer._apply_gated_norm(out, gate.contiguous()).reshape(B, S, -1).transpose(0, 1).contiguous()
    return layer.out_proj(out)


def build_layer(spec, dtype: torch.dtype = torch.float32):
    """A Megatron ``GatedDeltaNet`` of a hybrid `ModelSpec`'s linear layers (local spec: plain
    column/row parallel linears and a torch RMSNorm; call after Megatron's parallel state is
    initialised). flash-linear-attention is only needed by Megatron's own forward, which
    `tree_forward` replaces, so its constructor's check is skipped where it is absent."""
    cfg = TransformerConfig(
        num_layers=spec.layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
        use_cpu_initialization=True, params_dtype=dtype, normalization="RMSNorm", layernorm_epsilon=spec.eps,
        activation_func=F.silu, add_bias_linear=False, experimental_attention_variant="gated_delta_net",
        linear_attention_freq=len(spec.layer_types) // max(1, len(spec.full_layers)),
        linear_conv_kernel_dim=spec.conv_kernel, linear_key_head_dim=spec.lin_k_dim,
        linear_value_head_dim=spec.lin_v_dim, linear_num_key_heads=spec.lin_k_heads,
        linear_num_value_heads=spec.lin_v_heads)
    sub = mgdn.GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=LocalSpecProvider().layer_norm(rms_norm=True),
                                       out_proj=RowParallelLinear)
    have = mgdn.HAVE_FLA
    mgdn.HAVE_FLA = True
    try:
        return mgdn.GatedDeltaNet(cfg, sub, layer_number=1, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    finally:
        mgdn.HAVE_FLA = have


@torch.no_grad()
def load_from_gyre(layer, gdn) -> None:
    """Copy a Gyre (= transformers Qwen3.5) ``GatedDeltaNet``'s weights into a Megatron one:
    in_proj = [qkv; z; b; a] rows, the rest one to one."""
    if gdn.fused:
        raise NotImplementedError("load_from_gyre: Qwen3-Next's grouped in_proj_qkvz layout is not mapped")
    layer.in_proj.weight.copy_(torch.cat([gdn.in_proj_qkv.weight, gdn.in_proj_z.weight, gdn.in_proj_b.weight,
                                          gdn.in_proj_a.weight]))
    layer.conv1d.weight.copy_(gdn.conv1d.weight)
    layer.A_log.copy_(gdn.A_log)
    layer.dt_bias.copy_(gdn.dt_bias)
    layer.out_norm.weight.copy_(gdn.norm.weight)
    layer.out_proj.weight.copy_(gdn.out_proj.weight)
