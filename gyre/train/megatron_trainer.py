"""Megatron-Core backend: GPTModel + Megatron DDP + `get_megatron_optimizer` + `finalize_model_grads`.

Data parallel over the default process group (gloo on CPU, nccl on GPU). Tensor parallelism
(`train.tensor_parallel`): Megatron's own layers, weights cut by gyre/train/megatron_layout.py;
a TP 2 step equals the one-process step (tests/train/test_megatron_layouts.py). Pipeline
parallelism: a trainer can be built at `train.pipeline_parallel` > 1 (each stage its layers) to
save and load checkpoints, but it does not run Megatron's pipeline schedule, so its forward
refuses (and the configuration refuses training at pipeline_parallel > 1).
Gradients are *summed* across ranks (see `calculate_per_token_loss` in megatron_model): the loss
weights of a step already divide by the step's executions, wherever they were computed.

Context parallelism (`train.context_parallel` > 1, gyre/train/context_parallel.py): the ranks of
one CP group get the same rows; each packs them into one THD stream, keeps its two chunks of every
row, runs GPTModel on them with PackedSeqParams (Transformer Engine's attention does the ring) and
takes the loss over the targets predicted at its own tokens only. Megatron DDP sums gradients over
data x context parallel ranks (the dp-cp group, scaling 1 under calculate_per_token_loss), so the
sum of the CP ranks' partial losses is the whole micro-batch's. Transformer Engine's attention is
CUDA only: on the CPU this path runs with a stand-in for it (tests/support/cp_attention.py, two gloo
ranks); the real one runs in benchmarks/gpu_check.sh where two GPUs are visible (the device lent to
this project has one, so it has not run there).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor

from gyre.config import TrainConfig
from gyre.batch import MicroBatch
from gyre.model.megatron_names import as_spec
from gyre.train.dist import init_megatron
from gyre.train.offload import HostStash, PhaseTimer
from gyre.train.base import ATTENTION_PATHS, Trainer, phase_timings, torch_dtype
from gyre.train.reference import Reference
from gyre.train.routing_replay import check_model, replayed
from gyre.train.logprobs import rows_at, target_logprobs
from gyre.train.tree_attention import TreeMask
from gyre.train import context_parallel as cpar


class MegatronTrainer(Trainer):
    def __init__(self, cfg: TrainConfig, hf_config, hf_state: dict[str, Tensor], *, seed: int = 0,
                 attention: str = "tree") -> None:
        super().__init__(cfg)
        if attention not in ATTENTION_PATHS:
            raise ValueError(f"attention {attention!r}: choose one of {', '.join(ATTENTION_PATHS)}")
        self.attention = attention
        init_megatron(tensor_parallel=cfg.tensor_parallel, pipeline_parallel=cfg.pipeline_parallel,
                      expert_parallel=cfg.expert_parallel, context_parallel=cfg.context_parallel,
                      seed=seed)  # a no-op when the cell did it
        self.cp_rank, self.cp_size = self._context_parallel(cfg)
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from gyre.train.megatron_model import build_gpt_model, load_hf_weights  # Megatron-Core: when this backend runs

        self.hf_config = hf_config
        self.dtype = torch_dtype(cfg.dtype)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        check_model(cfg, len(as_spec(hf_config).moe_layers))
        model = build_gpt_model(hf_config, dtype=self.dtype, moe_aux_loss_coef=cfg.moe_aux_loss_coef,
                                routing_replay=cfg.routing_replay, recompute=cfg.recompute,
                                context_parallel=cfg.context_parallel)
        load_hf_weights(model, {k: v.to(self.dtype) for k, v in hf_state.items()}, hf_config)
        model.to(self.device)
        self.model = model
        if self.reg.needs_reference:  # the initial weights, frozen, in the model dtype (gyre.train.reference)
            ref = build_gpt_model(hf_config, dtype=self.dtype, moe_aux_loss_coef=0.0,
                                  routing_replay=cfg.routing_replay, recompute=False,
                                  context_parallel=cfg.context_parallel)
            load_hf_weights(ref, {k: v.to(self.dtype) for k, v in hf_state.items()}, hf_config)
            ref.to(self.device)
            self.reference = Reference({"model": ref, "ddp": ref})  # the forward calls both names
        self.ddp = DistributedDataParallel(
            config=model.config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False),
            module=model)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=cfg.lr, weight_decay=cfg.weight_decay,
                            adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
                            clip_grad=cfg.grad_clip, bf16=self.dtype == torch.bfloat16,
                            params_dtype=self.dtype, min_lr=cfg.min_lr),
            [self.ddp])
        # Megatron's own scheduler (the formulas of gyre.train.lr_schedule); its position is set
        # from self.step in _set_lr, so a restored checkpoint continues the schedule
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        sch = self.schedule
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=sch.lr, min_lr=sch.min_lr, lr_warmup_steps=sch.warmup_steps,
            lr_decay_steps=sch.horizon, lr_decay_style=sch.style, start_wd=cfg.weight_decay,
            end_wd=cfg.weight_decay, wd_incr_steps=0, wd_incr_style="constant")
        self._set_lr()
        self._offloaded: dict[str, HostStash] | None = None
        self._grads_reduced = False  # flat_grads already ran the data-parallel reduction
        self._plan: cpar.RankPlan | None = None  # the CP plan of the micro-batch being computed

    @staticmethod
    def _context_parallel(cfg: TrainConfig) -> tuple[int, int]:
        """(this rank's CP rank, CP size) from Megatron's parallel state, checked against the config."""
        if cfg.context_parallel == 1:
            return 0, 1
        from megatron.core import parallel_state

        size = parallel_state.get_context_parallel_world_size()
        if size != cfg.context_parallel:
            raise ValueError(f"train.context_parallel = {cfg.context_parallel} but Megatron's parallel state was "
                             f"initialised with a context-parallel size of {size}: initialise it with "
                             f"init_megatron(context_parallel=...) before the trainer")
        if cfg.routing_replay:
            raise ValueError("train.routing_replay with train.context_parallel > 1 is not supported (the replayed "
                             "routing would have to be cut like the rows): keep one of them off")
        return parallel_state.get_context_parallel_rank(), size

    def _set_lr(self) -> None:
        # Megatron counts the update that makes step n as num_steps n (gyre.train.lr_schedule)
        self.scheduler.num_steps = self.step
        self.scheduler.step(1)

    # --- context parallelism ------------------------------------------------------------------
    @contextmanager
    def _planned(self, plan: cpar.RankPlan):
        """`plan` for the forward inside: the base class calls _target_logprobs(mb) with no room for it."""
        self._plan = plan
        try:
            yield
        finally:
            self._plan = None

    def forward_backward(self, mb: MicroBatch, prox: Tensor | None = None) -> dict:
        """Under context parallelism: the loss over this rank's targets (DDP sums the CP ranks'
        gradients); its stats count its own targets and tokens, so a cell's merge sums to the
        micro-batch's."""
        if self.cp_size == 1:
            return super().forward_backward(mb, prox)
        plan = cpar.plan_micro_batch(mb, self.cp_size, self.cp_rank)
        local = cpar.select_targets(mb, plan.target_index)
        with self._planned(plan):
            stats = super().forward_backward(local, None if prox is None else prox[plan.target_index.to(prox.device)])
        self._acc["tokens"] += plan.num_tokens - stats["tokens"]  # the view's kv_end counts every rank's
        stats["tokens"] = plan.num_tokens
        return stats

    @torch.no_grad()
    def logprobs(self, mb: MicroBatch) -> Tensor:
        """Every target's log-prob on every CP rank: each computes its own, all-gathered over the group."""
        if self.cp_size == 1:
            return super().logprobs(mb)
        from megatron.core import parallel_state

        plan = cpar.plan_micro_batch(mb, self.cp_size, self.cp_rank)
        with self._planned(plan):
            local = self._target_logprobs(cpar.select_targets(mb, plan.target_index).to(self.device))
        group = parallel_state.get_context_parallel_group()

        def all_gather(t: Tensor) -> list[Tensor]:
            out = [torch.empty_like(t) for _ in range(self.cp_size)]
            torch.distributed.all_gather(out, t, group=group)
            return out

        return cpar.gather_target_logprobs(local, plan, all_gather).cpu()

    def _cp_hidden(self, mb: MicroBatch) -> tuple[Tensor, Tensor]:
        """GPTModel's hidden rows [n, 1, H] of this rank's THD tokens and, for each target of `mb`
        (all predicted on this rank), its row among them; the tokens and rows come from the plan
        forward_backward / logprobs made of the whole micro-batch."""
        from megatron.core.packed_seq_params import PackedSeqParams

        plan = self._plan
        if plan is None:
            raise RuntimeError("context parallelism: the forward runs inside forward_backward() or logprobs(), "
                               "which plan the micro-batch once; call one of them")
        packed = plan.packed
        if plan.target_index.numel() != mb.num_targets:
            raise ValueError("context parallelism: the micro-batch given to the forward holds targets of "
                             "other CP ranks; select this rank's targets first (context_parallel.select_targets)")
        dev = self.device
        i32 = dict(device=dev, dtype=torch.int32)
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=packed.cu_seqlens.to(**i32), cu_seqlens_kv=packed.cu_seqlens.to(**i32),
            cu_seqlens_q_padded=packed.cu_seqlens_padded.to(**i32),
            cu_seqlens_kv_padded=packed.cu_seqlens_padded.to(**i32),
            max_seqlen_q=packed.max_seqlen, max_seqlen_kv=packed.max_seqlen)
        self.ddp.train(torch.is_grad_enabled())
        self._moe_loss_scale(plan.input_ids.numel())
        hidden = self.ddp(plan.input_ids.to(dev), plan.position_ids.to(dev), None, packed_seq_params=params,
                          # the whole stream's positions: Megatron's THD RoPE takes this rank's chunks
                          rope_positions=packed.position_ids[None].to(dev))
        return hidden, plan.target_rows

    # --- hooks --------------------------------------------------------------------------------
    def _moe_aux_loss(self):
        """Megatron adds the aux loss itself (MoEAuxLossAutoScaler, in backward); its tracker holds
        the per-layer values of the forward, read and cleared here."""
        if not self.model.config.num_moe_experts or self.cfg.moe_aux_loss_coef <= 0:
            return None, None
        from megatron.core.transformer.moe.moe_utils import (clear_aux_losses_tracker,
                                                             get_moe_layer_wise_logging_tracker)

        entry = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
        value = float(entry["values"].sum()) if entry else None
        clear_aux_losses_tracker()
        return None, value

    def _target_logprobs(self, mb: MicroBatch, entropy: list | None = None, token_entropy: bool = False) -> Tensor:
        """Hidden states from GPTModel, then only the target rows through Megatron's output layer
        (ColumnParallelLinear: a vocab shard per tensor-parallel rank) and its vocab-parallel
        cross entropy, `train.logprob_chunk` rows at a time."""
        from megatron.core.parallel_state import get_tensor_model_parallel_world_size
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        self._one_stage()
        self.model.return_hidden = True
        try:
            if self.cp_size > 1:  # [n, 1, H] of this rank's THD tokens; the targets' rows among them
                hidden, rows = self._cp_hidden(mb)
            else:
                hidden, rows = self._forward(mb), mb.pred_pos  # [S, B, H], flat b*S+i
        finally:
            self.model.return_hidden = False
        weight = self.model.shared_embedding_or_output_weight() \
            if self.model.share_embeddings_and_output_weights else None

        def project(rows: Tensor) -> Tensor:  # [t, H] -> [t, V / tp]; the layer takes [s, b, H]
            return self.model.output_layer(rows[:, None], weight=weight)[0][:, 0]

        def logp_of(logits: Tensor, targets: Tensor) -> Tensor:
            return -vocab_parallel_cross_entropy(logits[:, None], targets[:, None])[:, 0]

        return target_logprobs(rows_at(hidden, rows, seq_first=True), project, mb.target_ids,
                               temperature=mb.temperature, chunk=self.cfg.logprob_chunk, logp_of=logp_of,
                               # entropy needs the whole vocabulary: one tensor-parallel rank holds it only at TP 1
                               entropy=entropy if get_tensor_model_parallel_world_size() == 1 else None,
                               token_entropy=token_entropy)

    def _one_stage(self) -> None:
        if self.cfg.pipeline_parallel > 1:
            raise NotImplementedError(f"train.pipeline_parallel = {self.cfg.pipeline_parallel}: Gyre's Megatron trainer "
                                      "does not run Megatron's pipeline schedule, so it cannot compute forward or "
                                      "backward at a pipeline stage (it can save and load checkpoints); train at "
                                      "pipeline_parallel = 1 and load the checkpoint there")

    def _logits(self, mb: MicroBatch) -> Tensor:
        self._one_stage()
        if self.cp_size > 1:  # [B, S, V] of whole rows is what context parallelism exists to avoid
            raise NotImplementedError("full logits are not computed under train.context_parallel > 1; "
                                      "use logprobs() (target log-probs, gathered over the CP group)")
        return self._forward(mb)

    def _forward(self, mb: MicroBatch) -> Tensor:
        """GPTModel's output: [B, S, V] logits, or [S, B, H] hidden states with return_hidden."""
        self.ddp.train(torch.is_grad_enabled())
        self._moe_loss_scale(mb.input_ids.numel())
        if self.attention == "tree" and mb.kv_end is not None:
            mask = TreeMask.build(mb.kv_end)  # TreeCoreAttention (megatron_model) follows it
        else:
            mask = mb.dense_mask()
        return self.ddp(mb.input_ids, mb.position_ids, mask, routed_experts=replayed(self.cfg, mb))

    def _moe_loss_scale(self, tokens: int) -> None:
        if self.model.config.num_moe_experts and torch.is_grad_enabled():
            from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, clear_aux_losses_tracker

            clear_aux_losses_tracker()  # only this forward's values are logged
            # with calculate_per_token_loss Megatron multiplies the aux loss by the micro-batch's
            # tokens (it expects finalize_model_grads to divide by them; Gyre's loss weights are
            # final already): scale it back so the aux term is coef x loss per micro-batch, as
            # in the embedded trainer
            MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / tokens, device=self.device))

    def _apply_gradients(self) -> float:
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.ddp])  # data-parallel all-reduce (a sum, see module doc)
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise FloatingPointError("optimizer step skipped: non-finite gradients")
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        return float(grad_norm) if grad_norm is not None else float("nan")

    # --- gradients reduced outside the trainer ------------------------------------------------
    def _grad_params(self) -> list[Tensor]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _grad_views(self, create: bool) -> list[Tensor]:
        # main_grad: fp32 views into the DDP grad buffers (grad_reduce_in_fp32), always allocated
        return [p.main_grad for p in self._grad_params()]

    def flat_grads(self) -> Tensor:
        # reduce over this trainer's own data-parallel ranks first, once per step
        if self._acc["micro_batches"] and not self._grads_reduced:
            from megatron.core.distributed import finalize_model_grads

            finalize_model_grads([self.ddp])
            self._grads_reduced = True
        return super().flat_grads()

    def _apply_set_gradients(self) -> float:
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise FloatingPointError("optimizer step skipped: non-finite gradients")
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._grads_reduced = False
        return float(grad_norm) if grad_norm is not None else float("nan")

    def clear_gradients(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._grads_reduced = False
        self._reset_step_stats()

    def hf_state_dict(self) -> dict[str, Tensor]:
        from gyre.train.megatron_model import megatron_to_hf, model_state  # as above

        return megatron_to_hf(model_state(self.model), self.hf_config)  # gathers experts under EP

    # --- offload ------------------------------------------------------------------------------
    def _inner_optimizers(self) -> list:
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def _optimizer_tensors(self) -> list[Tensor]:
        out = []
        for opt in self._inner_optimizers():
            for group in opt.optimizer.param_groups:
                out += group["params"]  # fp32 main params (bf16) or the model params (fp32)
            out += [v for s in opt.optimizer.state.values() for v in s.values() if isinstance(v, Tensor)]
        return out

    def offload(self) -> dict:
        """Params, grad buffers and optimizer state off the accelerator; timings per phase.

        On GPU: Megatron's own RL calls (`optimizer.offload_to_cpu`, `offload_grad_buffers`) plus
        a host copy of the model params. On CPU those calls move nothing, so the equivalent runs:
        every storage is copied to a host buffer and released (`HostStash`), grad buffers freed.
        """
        if self._offloaded is not None:
            raise RuntimeError("already offloaded")
        self._check_between_steps()
        timer, moved, stashes = PhaseTimer(), {}, {}
        cuda = self.device.type == "cuda"
        with timer("optimizer"):
            if cuda:
                for opt in self._inner_optimizers():
                    opt.offload_to_cpu()
                moved["optimizer"] = 0
            else:
                stashes["optimizer"] = HostStash()
                moved["optimizer"] = stashes["optimizer"].offload(self._optimizer_tensors())
        with timer("grads"):
            moved["grads"] = sum(b.grad_data.numel() * b.grad_data.element_size() for b in self.ddp.buffers)
            self.ddp.offload_grad_buffers(synchronize=cuda, empty_cache=cuda)
        with timer("params"):
            stashes["params"] = HostStash()
            ref = self.reference.parameters() if self.reference is not None else []
            moved["params"] = stashes["params"].offload(
                p for p in [*self.model.parameters(), *ref] if p.device.type == self.device.type)
        self._offloaded = stashes
        return phase_timings(timer, moved)

    def restore(self) -> dict:
        if self._offloaded is None:
            raise RuntimeError("not offloaded")
        timer, moved = PhaseTimer(), {}
        cuda = self.device.type == "cuda"
        with timer("params"):
            moved["params"] = self._offloaded["params"].restore()
        with timer("grads"):
            self.ddp.restore_grad_buffers(synchronize=cuda)  # zeroed: offload is between steps
            moved["grads"] = sum(b.grad_data.numel() * b.grad_data.element_size() for b in self.ddp.buffers)
        with timer("optimizer"):
            if cuda:
                for opt in self._inner_optimizers():
                    opt.restore_from_cpu()
                moved["optimizer"] = 0
            else:
                moved["optimizer"] = self._offloaded["optimizer"].restore()
        self._offloaded = None
        return phase_timings(timer, moved)

    # --- checkpoint ---------------------------------------------------------------------------
    def _state(self) -> dict:
        """Collective: every rank gives its experts; the state holds the whole model in
        transformers names, whatever the parallel layout (gyre/train/megatron_checkpoint.py)."""
        from gyre.train.megatron_checkpoint import save_state  # as above

        return save_state(self)

    def _load_state(self, state: dict) -> None:
        from gyre.train.megatron_checkpoint import FORMAT, load_state  # as above

        if state.get("format") == FORMAT:
            load_state(self, state)
            return
        # written before layout-free checkpoints: this layout's own Megatron names
        missing, unexpected = self.model.load_state_dict(state["model"], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise KeyError(f"checkpoint mismatch: missing {missing}, unexpected {unexpected}")
        self.optimizer.load_state_dict(state["optimizer"])
