"""A Megatron-Core GPTModel that is an exact clone of a transformers Qwen2 model.

`build_gpt_model` turns a Qwen2 config into a GPTModel (local layer spec: no Transformer Engine),
and `hf_to_megatron` / `megatron_to_hf` convert state dicts between the two layouts exactly.
RoPE is computed at the *given* position_ids: tree-packed rows carry tree depth, not 0..S-1,
and stock GPTModel silently ignores position_ids under `position_embedding_type="rope"`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.transformer_config import TransformerConfig

from gyre.train.tree_attention import TreeMask


class PositionalRotaryEmbedding(RotaryEmbedding):
    """RoPE frequencies for explicit positions; `positions` [B, S] is set by the model per forward."""

    positions: Tensor | None = None

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False,
                cp_group=None) -> Tensor:
        if self.positions is None:
            return super().forward(max_seq_len, offset, packed_seq, cp_group)
        pos = self.positions.to(device=self.inv_freq.device, dtype=self.inv_freq.dtype)
        freqs = pos[..., None] * self.inv_freq  # [B, S, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # non-interleaved, as in Qwen2
        return emb.transpose(0, 1)[:, :, None, :].contiguous()  # [S, B, 1, dim]


class TreeCoreAttention(DotProductAttention):
    """Megatron's core-attention seam (`SelfAttentionSubmodules.core_attention`) for tree rows.

    Given a `TreeMask` as attention_mask (passed through GPTModel -> TransformerBlock ->
    SelfAttention unchanged), attention follows the tree: FlexAttention block masks on CUDA,
    the exact block-sparse path on the CPU. Given a dense [B,1,S,S] bool mask it is Megatron's
    own DotProductAttention. Tensor parallel 1 (heads are not split here).
    """

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask,
                attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> Tensor:
        if not isinstance(attention_mask, TreeMask):
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("tree attention takes no packed_seq_params or attention_bias")
        # Megatron: [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        scale = self.softmax_scale  # undo query-key layer scaling: the softmax multiplies it back
        if self.config.apply_query_key_layer_scaling:
            scale *= self.layer_number
        out = attention_mask.attend(q, k, v, scale)  # [b, heads, s, d]
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)


class QwenGPTModel(GPTModel):
    """GPTModel whose RoPE follows position_ids (tree depth for packed trees)."""

    def forward(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor,
                **kwargs) -> Tensor:
        if attention_mask is None:  # the default causal mask is built with device="cuda"
            raise ValueError("pass an explicit [B,1,S,S] boolean attention_mask (True = masked) "
                             "or a gyre.train.tree_attention.TreeMask")
        self.rotary_pos_emb.positions = position_ids
        try:
            return super().forward(input_ids, position_ids, attention_mask, **kwargs)
        finally:
            self.rotary_pos_emb.positions = None


def transformer_config(hf_config, *, dtype: torch.dtype = torch.float32,
                       use_cpu_initialization: bool = True) -> TransformerConfig:
    """Megatron TransformerConfig with the architecture of a transformers Qwen2/Llama config."""
    c = hf_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return TransformerConfig(
        num_layers=c.num_hidden_layers,
        hidden_size=c.hidden_size,
        ffn_hidden_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_key_value_heads,
        kv_channels=head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=c.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=c.model_type == "qwen2",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # fusions need CUDA kernels and change rounding; exactness matters more here
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=use_cpu_initialization,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        init_method_std=getattr(c, "initializer_range", 0.02),
        # loss weights are precomputed for the whole step, so data-parallel grads must be summed,
        # not averaged: this makes Megatron DDP use a scaling factor of 1
        calculate_per_token_loss=True,
    )


def build_gpt_model(hf_config, *, dtype: torch.dtype = torch.float32,
                    use_cpu_initialization: bool = True) -> QwenGPTModel:
    """A GPTModel with Qwen2's architecture (call after Megatron's parallel state is initialised)."""
    # transformers 5 keeps RoPE settings in rope_parameters; 4.x in rope_theta / rope_scaling
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"only plain RoPE is supported, got {rope}")
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = TreeCoreAttention
    model = QwenGPTModel(
        config=transformer_config(hf_config, dtype=dtype, use_cpu_initialization=use_cpu_initialization),
        transformer_layer_spec=spec,
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=theta,
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
    )
    rot = model.rotary_pos_emb
    rot.__class__ = PositionalRotaryEmbedding  # same state, forward that honours positions
    return model


# --- weight layouts --------------------------------------------------------------------------

_LAYER_SIMPLE = {  # Megatron suffix -> HF suffix, within one decoder layer
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def _dims(hf_config) -> tuple[int, int, int]:
    heads, groups = hf_config.num_attention_heads, hf_config.num_key_value_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return heads // groups, groups, head_dim


def _pack_qkv(q: Tensor, k: Tensor, v: Tensor, hf_config) -> Tensor:
    """HF q/k/v (weights or biases) -> linear_qkv: per KV group its query heads, key, value."""
    per, groups, d = _dims(hf_config)
    rest = q.shape[1:]
    q = q.reshape(groups, per * d, *rest)
    k = k.reshape(groups, d, *rest)
    v = v.reshape(groups, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(groups * (per + 2) * d, *rest)


def _unpack_qkv(qkv: Tensor, hf_config) -> tuple[Tensor, Tensor, Tensor]:
    per, groups, d = _dims(hf_config)
    rest = qkv.shape[1:]
    g = qkv.reshape(groups, (per + 2) * d, *rest)
    q, k, v = torch.split(g, [per * d, d, d], dim=1)
    return (q.reshape(groups * per * d, *rest), k.reshape(groups * d, *rest),
            v.reshape(groups * d, *rest))


def hf_to_megatron(hf_sd: dict[str, Tensor], hf_config) -> dict[str, Tensor]:
    """transformers state dict -> GPTModel state dict (load with strict=False: `_extra_state`)."""
    out = {"embedding.word_embeddings.weight": hf_sd["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf_sd["model.norm.weight"]}
    if not hf_config.tie_word_embeddings:
        out["output_layer.weight"] = hf_sd["lm_head.weight"]
    for i in range(hf_config.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for msuf, hsuf in _LAYER_SIMPLE.items():
            out[m + msuf] = hf_sd[h + hsuf]
        a = h + "self_attn."
        out[m + "self_attention.linear_qkv.weight"] = _pack_qkv(
            hf_sd[a + "q_proj.weight"], hf_sd[a + "k_proj.weight"], hf_sd[a + "v_proj.weight"], hf_config)
        if a + "q_proj.bias" in hf_sd:
            out[m + "self_attention.linear_qkv.bias"] = _pack_qkv(
                hf_sd[a + "q_proj.bias"], hf_sd[a + "k_proj.bias"], hf_sd[a + "v_proj.bias"], hf_config)
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [hf_sd[h + "mlp.gate_proj.weight"], hf_sd[h + "mlp.up_proj.weight"]], dim=0)
    return out


def megatron_to_hf(mg_sd: dict[str, Tensor], hf_config) -> dict[str, Tensor]:
    """GPTModel state dict -> transformers state dict (`_extra_state` entries are dropped)."""
    out = {"model.embed_tokens.weight": mg_sd["embedding.word_embeddings.weight"],
           "model.norm.weight": mg_sd["decoder.final_layernorm.weight"]}
    if not hf_config.tie_word_embeddings:
        out["lm_head.weight"] = mg_sd["output_layer.weight"]
    for i in range(hf_config.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for msuf, hsuf in _LAYER_SIMPLE.items():
            out[h + hsuf] = mg_sd[m + msuf]
        a = h + "self_attn."
        q, k, v = _unpack_qkv(mg_sd[m + "self_attention.linear_qkv.weight"], hf_config)
        out[a + "q_proj.weight"], out[a + "k_proj.weight"], out[a + "v_proj.weight"] = q, k, v
        bias = mg_sd.get(m + "self_attention.linear_qkv.bias")
        if bias is not None:
            q, k, v = _unpack_qkv(bias, hf_config)
            out[a + "q_proj.bias"], out[a + "k_proj.bias"], out[a + "v_proj.bias"] = q, k, v
        gate, up = torch.chunk(mg_sd[m + "mlp.linear_fc1.weight"], 2, dim=0)
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
    return {k: v.contiguous() for k, v in out.items()}


def load_hf_weights(model: GPTModel, hf_sd: dict[str, Tensor], hf_config) -> None:
    """Copy transformers weights into a GPTModel; every parameter must be covered."""
    mg = hf_to_megatron(hf_sd, hf_config)
    missing, unexpected = model.load_state_dict(mg, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise KeyError(f"weight conversion mismatch: missing {missing}, unexpected {unexpected}")


def model_state(model: GPTModel) -> dict[str, Tensor]:
    """Parameters only (no `_extra_state`), detached, as the conversion functions expect."""
    return {k: v.detach() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
