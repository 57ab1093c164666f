"""HF (checkpoint) <-> Megatron-Core GPTModel state-dict names, per family, both directions.

The one place that knows both layouts (the Megatron side is the local layer spec:
`get_gpt_layer_local_spec`, SequentialMLP experts). Measured layouts (Megatron-Core 0.16.1):

* ``linear_qkv`` holds, per KV group, that group's query heads, then its key head, then its value
  head (weights and biases); ``linear_fc1`` is gate then up.
* q/k RMSNorm (Qwen3): ``self_attn.q_norm`` <-> ``self_attention.q_layernorm`` (same for k).
* Routed experts: ``mlp.gate`` <-> ``mlp.router``; expert E's gate/up/down <->
  ``mlp.experts.local_experts.L.linear_fc1`` / ``linear_fc2`` where, with expert parallelism of
  size P, rank r holds experts r*E/P .. (r+1)*E/P - 1 as local L = E - r*E/P.
* Shared expert (Qwen2-MoE): ``mlp.shared_expert.*`` <-> ``mlp.shared_experts.linear_fc1/2``,
  ``mlp.shared_expert_gate.weight`` <-> ``mlp.shared_experts.gate_weight``.

Megatron's ``_extra_state`` entries are not weights and are ignored. Grouped-GEMM experts
(TEGroupedMLP, CUDA) name local expert L's weights ``mlp.experts.linear_fc1.weightL``:
`to_grouped_gemm` / `from_grouped_gemm` rename between the two expert layouts.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from gyre.model.families import ModelFormatError
from gyre.model.spec import ModelSpec

_LAYER_SIMPLE = {  # Megatron suffix -> HF suffix, within one decoder layer
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
}
_QK_NORM = {"self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
            "self_attention.k_layernorm.weight": "self_attn.k_norm.weight"}


def as_spec(config) -> ModelSpec:
    """A ModelSpec from a config.json dict, a transformers config or a ModelSpec."""
    if isinstance(config, ModelSpec):
        return config
    return ModelSpec(dict(config) if isinstance(config, dict) else config.to_dict())


def local_experts(spec: ModelSpec, ep_rank: int = 0, ep_size: int = 1) -> range:
    """The global expert ids an expert-parallel rank holds."""
    if spec.experts % ep_size:
        raise ModelFormatError(f"{spec.experts} experts cannot be split over expert_parallel={ep_size}; "
                               f"choose a size that divides the expert count")
    per = spec.experts // ep_size
    return range(ep_rank * per, (ep_rank + 1) * per)


def _dims(spec: ModelSpec) -> tuple[int, int, int]:
    return spec.heads // spec.kv_heads, spec.kv_heads, spec.head_dim


def pack_qkv(q: Tensor, k: Tensor, v: Tensor, spec: ModelSpec) -> Tensor:
    """HF q/k/v (weights or biases) -> linear_qkv: per KV group its query heads, key, value."""
    per, groups, d = _dims(spec)
    rest = q.shape[1:]
    q = q.reshape(groups, per * d, *rest)
    k = k.reshape(groups, d, *rest)
    v = v.reshape(groups, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(groups * (per + 2) * d, *rest)


def unpack_qkv(qkv: Tensor, spec: ModelSpec) -> tuple[Tensor, Tensor, Tensor]:
    per, groups, d = _dims(spec)
    rest = qkv.shape[1:]
    g = qkv.reshape(groups, (per + 2) * d, *rest)
    q, k, v = torch.split(g, [per * d, d, d], dim=1)
    return (q.reshape(groups * per * d, *rest), k.reshape(groups * d, *rest),
            v.reshape(groups * d, *rest))


def _mlp_pairs(hf: str, mg: str) -> tuple[str, str, str, str, str]:
    return hf + "gate_proj.weight", hf + "up_proj.weight", hf + "down_proj.weight", \
        mg + "linear_fc1.weight", mg + "linear_fc2.weight"


def _mlps(spec: ModelSpec, i: int, ep_rank: int, ep_size: int):
    """(HF prefix, Megatron prefix) of every gated MLP of layer i on this expert-parallel rank."""
    h, m = f"model.layers.{i}.mlp.", f"decoder.layers.{i}.mlp."
    if not spec.is_moe(i):
        return [(h, m)]
    experts = local_experts(spec, ep_rank, ep_size)
    out = [(f"{h}experts.{e}.", f"{m}experts.local_experts.{e - experts.start}.") for e in experts]
    if spec.shared_intermediate:
        out.append((h + "shared_expert.", m + "shared_experts."))
    return out


def hf_to_megatron(hf_sd: dict[str, Tensor], config, *, ep_rank: int = 0, ep_size: int = 1) -> dict[str, Tensor]:
    """Checkpoint state dict -> GPTModel state dict of one expert-parallel rank (load with
    strict=False: `_extra_state`)."""
    spec = as_spec(config)
    out = {"embedding.word_embeddings.weight": hf_sd["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf_sd["model.norm.weight"]}
    if not spec.tied:
        out["output_layer.weight"] = hf_sd["lm_head.weight"]
    for i in range(spec.layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for msuf, hsuf in _LAYER_SIMPLE.items() | (_QK_NORM.items() if spec.qk_norm else {}.items()):
            out[m + msuf] = hf_sd[h + hsuf]
        a = h + "self_attn."
        out[m + "self_attention.linear_qkv.weight"] = pack_qkv(
            hf_sd[a + "q_proj.weight"], hf_sd[a + "k_proj.weight"], hf_sd[a + "v_proj.weight"], spec)
        if spec.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = pack_qkv(
                hf_sd[a + "q_proj.bias"], hf_sd[a + "k_proj.bias"], hf_sd[a + "v_proj.bias"], spec)
        for hp, mp in _mlps(spec, i, ep_rank, ep_size):
            gate, up, down, fc1, fc2 = _mlp_pairs(hp, mp)
            out[fc1] = torch.cat([hf_sd[gate], hf_sd[up]], dim=0)
            out[fc2] = hf_sd[down]
        if spec.is_moe(i):
            out[m + "mlp.router.weight"] = hf_sd[h + "mlp.gate.weight"]
            if spec.shared_intermediate:
                out[m + "mlp.shared_experts.gate_weight"] = hf_sd[h + "mlp.shared_expert_gate.weight"]
    return out


def megatron_to_hf(mg_sd: dict[str, Tensor], config, *, ep_rank: int = 0, ep_size: int = 1) -> dict[str, Tensor]:
    """GPTModel state dict of one expert-parallel rank -> checkpoint names (its experts under
    their global ids; `_extra_state` entries dropped)."""
    spec = as_spec(config)
    out = {"model.embed_tokens.weight": mg_sd["embedding.word_embeddings.weight"],
           "model.norm.weight": mg_sd["decoder.final_layernorm.weight"]}
    if not spec.tied:
        out["lm_head.weight"] = mg_sd["output_layer.weight"]
    for i in range(spec.layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for msuf, hsuf in _LAYER_SIMPLE.items() | (_QK_NORM.items() if spec.qk_norm else {}.items()):
            out[h + hsuf] = mg_sd[m + msuf]
        a = h + "self_attn."
        q, k, v = unpack_qkv(mg_sd[m + "self_attention.linear_qkv.weight"], spec)
        out[a + "q_proj.weight"], out[a + "k_proj.weight"], out[a + "v_proj.weight"] = q, k, v
        if spec.qkv_bias:
            q, k, v = unpack_qkv(mg_sd[m + "self_attention.linear_qkv.bias"], spec)
            out[a + "q_proj.bias"], out[a + "k_proj.bias"], out[a + "v_proj.bias"] = q, k, v
        for hp, mp in _mlps(spec, i, ep_rank, ep_size):
            gate, up, down, fc1, fc2 = _mlp_pairs(hp, mp)
            out[gate], out[up] = torch.chunk(mg_sd[fc1], 2, dim=0)
            out[down] = mg_sd[fc2]
        if spec.is_moe(i):
            out[h + "mlp.gate.weight"] = mg_sd[m + "mlp.router.weight"]
            if spec.shared_intermediate:
                out[h + "mlp.shared_expert_gate.weight"] = mg_sd[m + "mlp.shared_experts.gate_weight"]
    return {k: v.contiguous() for k, v in out.items()}


_SEQUENTIAL = re.compile(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_GROUPED = re.compile(r"^(.*\.mlp\.experts\.)(linear_fc[12])\.weight(\d+)$")


def to_grouped_gemm(mg_sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """SequentialMLP expert names -> TEGroupedMLP's (``linear_fc1.weightL``); others unchanged."""
    out = {}
    for k, v in mg_sd.items():
        m = _SEQUENTIAL.match(k)
        out[f"{m[1]}{m[3]}.weight{m[2]}" if m else k] = v
    return out


def from_grouped_gemm(mg_sd: dict[str, Tensor]) -> dict[str, Tensor]:
    out = {}
    for k, v in mg_sd.items():
        m = _GROUPED.match(k)
        out[f"{m[1]}local_experts.{m[3]}.{m[2]}.weight" if m else k] = v
    return out
