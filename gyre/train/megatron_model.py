"""A Megatron-Core GPTModel that is an exact clone of a transformers model of a `gyre.model` family
(Qwen2, Llama, Qwen3 with q/k layernorm, Qwen3-MoE / Qwen2-MoE with routed experts).

`build_gpt_model` turns a config into a GPTModel (local layer spec: no Transformer Engine; MoE
layers with SequentialMLP experts, expert parallelism from Megatron's parallel state), and
`hf_to_megatron` / `megatron_to_hf` convert state dicts between the two layouts exactly (the name
maps themselves are `gyre.model.megatron_names`; the tensor/pipeline-parallel cuts
gyre/train/megatron_layout.py).
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

from gyre.model import megatron_names as names
from gyre.model.families import ModelFormatError
from gyre.model.megatron_names import as_spec, pack_qkv
from gyre.model.spec import split_fused_experts
from gyre.train.tree_attention import TreeMask


class PositionalRotaryEmbedding(RotaryEmbedding):
    """RoPE frequencies for explicit positions; `positions` [B, S] is set by the model per forward."""

    positions: Tensor | None = None

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False,
                cp_group=None) -> Tensor:
        if self.positions is None:
            return super().forward(max_seq_len, offset, packed_seq, cp_group)
        if self.inv_freq.device != self.positions.device:
            # not a buffer, so `model.to("cuda")` leaves it where it was built (the CPU under
            # use_cpu_initialization): follow the positions (found on an H200, issue 41's GPU run)
            self.inv_freq = self.inv_freq.to(self.positions.device)
        pos = self.positions.to(dtype=self.inv_freq.dtype)
        freqs = pos[..., None] * self.inv_freq  # [B, S, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # non-interleaved, as in Qwen2
        return emb.transpose(0, 1)[:, :, None, :].contiguous()  # [S, B, 1, dim]


class TreeCoreAttention(DotProductAttention):
    """Megatron's core-attention seam (`SelfAttentionSubmodules.core_attention`) for tree rows.

    Given a `TreeMask` as attention_mask (passed through GPTModel -> TransformerBlock ->
    SelfAttention unchanged), attention follows the tree: FlexAttention block masks on CUDA,
    the exact block-sparse path on the CPU. Given a dense [B,1,S,S] bool mask it is Megatron's
    own DotProductAttention. Under tensor parallelism each rank attends its own heads.
    """

    tree_mask: TreeMask | None = None  # set by QwenGPTModel.forward; its kv_end travels as the mask

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask,
                attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> Tensor:
        if isinstance(attention_mask, Tensor) and attention_mask.dim() == 2 and self.tree_mask is not None:
            if tuple(attention_mask.shape) != self.tree_mask.shape:
                raise ValueError(f"tree mask is for {self.tree_mask.shape}, attention got a kv_end of "
                                 f"{tuple(attention_mask.shape)}")
            attention_mask = self.tree_mask
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
    """GPTModel whose RoPE follows position_ids (tree depth for packed trees) and which can replay
    given MoE routing (`routed_experts` ``[B, S, MoE layers, top_k]``, Megatron's RouterReplay)."""

    return_hidden = False  # forward returns the decoder's final normed hidden states [S, B, H]

    def _postprocess(self, hidden_states, *args, **kwargs):
        # Gyre projects only the target rows (gyre.train.logprobs), never [S, B, vocab] logits
        if self.return_hidden:
            return hidden_states
        return super()._postprocess(hidden_states, *args, **kwargs)

    def _replays(self) -> list:
        """This model's RouterReplay instances in layer order (Megatron's own list is global to the
        process and holds every model ever built)."""
        return [m.router_replay for m in self.modules() if getattr(m, "router_replay", None) is not None]

    @torch.no_grad()
    def _free_routing(self, replays: list, B: int, S: int, *args, **kwargs) -> Tensor:
        """[B, S, MoE layers, top_k] the routers' own choice (RouterReplay's RECORD action), from
        an eval-mode forward (no load-balancing loss is added or logged)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        was_training = self.training
        self.eval()
        for rep in replays:
            rep.set_router_replay_action(RouterReplayAction.RECORD)
        self.rotary_pos_emb.positions = args[1]
        try:
            super().forward(*args, **kwargs)
            return torch.stack([rep.get_recorded_indices().reshape(S, B, -1).transpose(0, 1)
                                for rep in replays], dim=2).long()
        finally:
            self.train(was_training)
            self.rotary_pos_emb.positions = None
            for rep in replays:
                rep.clear_router_replay_action()
                rep.clear_indices()

    def forward(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor | None,
                routed_experts: Tensor | None = None, rope_positions: Tensor | None = None, **kwargs) -> Tensor:
        """`rope_positions`: where RoPE is evaluated when not at `position_ids`: under context
        parallelism the whole THD stream's positions [1, P] (Megatron's THD RoPE cuts each rank's
        chunks out of them); packed THD input (`packed_seq_params`) takes no attention_mask."""
        if attention_mask is None and kwargs.get("packed_seq_params") is None:
            # the default causal mask is built with device="cuda"
            raise ValueError("pass an explicit [B,1,S,S] boolean attention_mask (True = masked) "
                             "or a gyre.train.tree_attention.TreeMask")
        replays = []
        if routed_experts is not None:
            from megatron.core.transformer.moe.router_replay import RouterReplayAction

            replays = self._replays()
            if len(replays) != routed_experts.shape[2]:
                raise ValueError(f"routed_experts has {routed_experts.shape[2]} MoE layers, the model "
                                 f"{len(replays)} (build it with routing_replay=True)")
            B, S = input_ids.shape
            routed_experts = routed_experts.to(input_ids.device)
            if (routed_experts < 0).any():  # not recorded there: route those tokens freely
                free = self._free_routing(replays, B, S, input_ids, position_ids, attention_mask, **kwargs)
                missing = (routed_experts < 0).any(-1, keepdim=True)
                routed_experts = torch.where(missing, free, routed_experts.long())
            for slot, rep in enumerate(replays):  # Megatron routes tokens sequence-first: [S, B] flattened
                rep.set_target_indices(routed_experts[:, :, slot].transpose(0, 1).reshape(S * B, -1)
                                       .to(device=input_ids.device, dtype=torch.long))
                rep.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        if isinstance(attention_mask, TreeMask):
            # Megatron's recompute (CheckpointFunction) saves its arguments with
            # save_for_backward, which takes tensors only: the layers get kv_end [B, S] and the
            # core attention the plan (kept until the next forward, for the recompute in backward)
            for m in self.modules():
                if isinstance(m, TreeCoreAttention):
                    m.tree_mask = attention_mask
            attention_mask = attention_mask.kv_end
        self.rotary_pos_emb.positions = position_ids if rope_positions is None else rope_positions
        try:
            return super().forward(input_ids, position_ids, attention_mask, **kwargs)
        finally:
            self.rotary_pos_emb.positions = None
            for rep in replays:
                rep.clear_router_replay_action()
                rep.clear_indices()


def transformer_config(hf_config, *, dtype: torch.dtype = torch.float32, use_cpu_initialization: bool = True,
                       moe_aux_loss_coef: float = 0.0, routing_replay: bool = False,
                       recompute: bool = False, context_parallel: int = 1) -> TransformerConfig:
    """Megatron TransformerConfig with the architecture of a config of a `gyre.model` family;
    `recompute`: Megatron's full activation recomputation of every layer (`train.recompute`);
    `context_parallel`: `train.context_parallel` (Transformer Engine's default p2p ring)."""
    spec = _gpt_spec(hf_config)
    if recompute:
        recompute_keys = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    else:
        recompute_keys = {}
    tensor_parallel, pipeline_parallel = _model_parallel_sizes()
    moe = {}
    if spec.experts:
        if len(spec.moe_layers) != spec.layers:
            raise ModelFormatError("the Megatron backend takes MoE models whose every layer is sparse "
                                   "(mlp_only_layers empty, decoder_sparse_step 1); use train.backend=embedded")
        moe = dict(
            num_moe_experts=spec.experts, moe_router_topk=spec.top_k, moe_ffn_hidden_size=spec.moe_intermediate,
            # softmax over all experts then top-k (Qwen) == Megatron's pre-softmax routing; renormalised
            # top-k probabilities == softmax over the top-k logits, Megatron's default
            moe_router_pre_softmax=not spec.norm_topk_prob, moe_router_dtype="fp32",
            # "allgather" needs no CUDA streams (alltoall creates one at construction)
            moe_token_dispatcher_type="alltoall" if torch.cuda.is_available() else "allgather",
            moe_grouped_gemm=False,
            moe_router_load_balancing_type="aux_loss" if moe_aux_loss_coef > 0 else "none",
            moe_aux_loss_coeff=moe_aux_loss_coef,
            # the layers mark expert weights as not data-parallel-reduced only when the config says
            # experts are split (parallel_state alone is not enough)
            expert_model_parallel_size=expert_parallel_rank()[1],
            moe_enable_routing_replay=routing_replay,
        )
        if spec.shared_intermediate:
            moe |= dict(moe_shared_expert_intermediate_size=spec.shared_intermediate, moe_shared_expert_gate=True)
    return TransformerConfig(
        num_layers=spec.layers,
        hidden_size=spec.hidden,
        ffn_hidden_size=spec.intermediate,
        num_attention_heads=spec.heads,
        num_query_groups=spec.kv_heads,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
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
        init_method_std=spec.raw.get("initializer_range", 0.02),
        # loss weights are precomputed for the whole step, so data-parallel grads must be summed,
        # not averaged: this makes Megatron DDP use a scaling factor of 1
        calculate_per_token_loss=True,
        context_parallel_size=context_parallel,
        # Megatron reads the layer split of a pipeline stage from the config, not its parallel state
        tensor_model_parallel_size=tensor_parallel, pipeline_model_parallel_size=pipeline_parallel,
        pipeline_dtype=dtype if pipeline_parallel > 1 else None,
        **moe,
        **recompute_keys,
    )


def _model_parallel_sizes() -> tuple[int, int]:
    """(tensor, pipeline) parallel sizes from Megatron's parallel state ((1, 1) without one)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1, 1
    return parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size()


def _gpt_spec(hf_config):
    spec = as_spec(hf_config)
    if spec.hybrid:
        raise ModelFormatError(
            f"{spec.model_type} has Gated DeltaNet layers, which Gyre's Megatron-Core GPTModel does not build; "
            "train it with train.backend = \"embedded\" (gyre/train/megatron_gdn.py wraps Megatron's GDN layer "
            "with initial/final states, checked only on a GPU: docs/hybrid-layers.md)")
    return spec


def build_gpt_model(hf_config, *, dtype: torch.dtype = torch.float32, use_cpu_initialization: bool = True,
                    moe_aux_loss_coef: float = 0.0, grouped_gemm: bool | None = None,
                    routing_replay: bool = False, recompute: bool = False,
                    context_parallel: int = 1) -> QwenGPTModel:
    """A GPTModel with the config's architecture (call after Megatron's parallel state is
    initialised). MoE families use SequentialMLP experts (the local spec) on the CPU; grouped GEMM
    (TEGroupedMLP, Transformer Engine) is for CUDA: `grouped_gemm` None = when CUDA and Transformer
    Engine are both there. `context_parallel` > 1: core attention is Transformer Engine's
    (TEDotProductAttention: THD rows with the ring across the cut), not the tree attention."""
    spec = as_spec(hf_config)
    if grouped_gemm is None:
        import importlib.util

        grouped_gemm = torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None
    config = transformer_config(spec, dtype=dtype, use_cpu_initialization=use_cpu_initialization,
                                moe_aux_loss_coef=moe_aux_loss_coef, routing_replay=routing_replay and bool(spec.experts),
                                recompute=recompute, context_parallel=context_parallel)
    layer = get_gpt_layer_local_spec(num_experts=spec.experts or None, moe_grouped_gemm=False,
                                     qk_layernorm=spec.qk_norm, normalization="RMSNorm")
    layer.submodules.self_attention.submodules.core_attention = \
        TreeCoreAttention if context_parallel == 1 else context_parallel_attention()
    if spec.experts and grouped_gemm:
        # CUDA: only the experts change (TEGroupedMLP, Transformer Engine's grouped GEMM); attention,
        # norms and names elsewhere stay the local spec's. Checked by benchmarks/gpu_check.sh only.
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

        config.moe_grouped_gemm = True
        layer.submodules.mlp = get_moe_module_spec(use_te=True, num_experts=spec.experts, moe_grouped_gemm=True)
    model = QwenGPTModel(
        config=config,
        transformer_layer_spec=layer,
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_positions,
        position_embedding_type="rope",
        rotary_base=spec.theta,
        share_embeddings_and_output_weights=spec.tied,
        # pipeline stages: the embedding on the first, final norm and output layer on the last
        pre_process=_pipeline_end(first=True), post_process=_pipeline_end(first=False),
    )
    rot = model.rotary_pos_emb
    rot.__class__ = PositionalRotaryEmbedding  # same state, forward that honours positions
    return model


def _pipeline_end(*, first: bool) -> bool:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return True
    return parallel_state.is_pipeline_first_stage() if first else parallel_state.is_pipeline_last_stage()


def context_parallel_attention() -> type:
    """Transformer Engine's core attention, the one Megatron-Core runs context parallelism with
    (Megatron's local DotProductAttention refuses context_parallel_size > 1). GPU only: checked by
    benchmarks/gpu_check.sh when two GPUs are visible."""
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is None:
        raise ModelFormatError("train.context_parallel > 1 needs Transformer Engine (its THD attention runs the "
                               "context-parallel ring): install transformer-engine on the trainer nodes, or "
                               "keep train.context_parallel = 1")
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    return TEDotProductAttention


# --- weight layouts (the name maps live in gyre.model.megatron_names) --------------------------

def _pack_qkv(q: Tensor, k: Tensor, v: Tensor, hf_config) -> Tensor:
    return pack_qkv(q, k, v, as_spec(hf_config))


def expert_parallel_rank() -> tuple[int, int]:
    """(rank, size) of this process in Megatron's expert-parallel group ((0, 1) without one)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return parallel_state.get_expert_model_parallel_rank(), parallel_state.get_expert_model_parallel_world_size()


def _grouped(model) -> bool:
    return bool(getattr(model.config, "moe_grouped_gemm", False)) if model is not None else False


def hf_to_megatron(hf_sd: dict[str, Tensor], hf_config, *, grouped: bool = False) -> dict[str, Tensor]:
    """Checkpoint state dict -> this rank's GPTModel state dict: its experts only under EP, its
    stage's layers (numbered from 0) under PP, its slice of each split weight under TP
    (gyre/train/megatron_layout.py)."""
    from gyre.train.megatron_layout import shard

    rank, size = expert_parallel_rank()
    spec = as_spec(hf_config)
    out = names.hf_to_megatron(split_fused_experts(hf_sd), spec, ep_rank=rank, ep_size=size)
    out = shard(out, spec.layers, tied=spec.tied)
    return names.to_grouped_gemm(out) if grouped else out


def megatron_to_hf(mg_sd: dict[str, Tensor], hf_config) -> dict[str, Tensor]:
    """This rank's GPTModel state dict -> the whole model in checkpoint names, on every rank.
    Collective: tensor-parallel slices are gathered over the tensor (and expert-tensor) group,
    pipeline stages over the pipeline group (gyre/train/megatron_layout.py), then the other
    ranks' experts over the expert-parallel group."""
    from gyre.train.megatron_layout import unshard

    rank, size = expert_parallel_rank()
    spec = as_spec(hf_config)
    whole = unshard(names.from_grouped_gemm(mg_sd), tied=spec.tied, num_layers=spec.layers)
    out = names.megatron_to_hf(whole, spec, ep_rank=rank, ep_size=size)
    if size > 1:
        from megatron.core import parallel_state

        mine = {k: v.cpu() for k, v in out.items() if ".mlp.experts." in k}
        gathered: list = [None] * size
        torch.distributed.all_gather_object(gathered, mine, group=parallel_state.get_expert_model_parallel_group())
        for part in gathered:
            out.update(part)
    return out


def load_hf_weights(model: GPTModel, hf_sd: dict[str, Tensor], hf_config) -> None:
    """Copy transformers weights into a GPTModel; every parameter must be covered."""
    mg = hf_to_megatron(hf_sd, hf_config, grouped=_grouped(model))
    missing, unexpected = model.load_state_dict(mg, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise KeyError(f"weight conversion mismatch: missing {missing}, unexpected {unexpected}")


def model_state(model: GPTModel) -> dict[str, Tensor]:
    """Parameters only (no `_extra_state`), detached, as the conversion functions expect."""
    return {k: v.detach() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
