"""The embedded backend: plain torch on Gyre's Qwen2 module (gyre.train.qwen2), one process.

The interface it implements is `gyre.train.base.Trainer`; backends are picked by name in
`gyre.train.backends`. Starts from a transformers-layout model directory (the engine's layout),
an in-memory `Qwen2LM`, or an in-memory transformers model (copied; tests and benchmarks), and
exports back to that layout.
"""

from __future__ import annotations

import copy
import math
import os

import torch
from torch import Tensor

from gyre.batch import MicroBatch
from gyre.config import TrainConfig
from gyre.train.base import ATTENTION_PATHS, Trainer, phase_timings, torch_dtype
from gyre.train.offload import HostStash, PhaseTimer
from gyre.model.families import read_config
from gyre.train.hybrid import lm_class
from gyre.train.logprobs import rows_at, target_logprobs
from gyre.train.qwen2 import Qwen2LM
from gyre.train.reference import Reference
from gyre.train.routing_replay import check_model, replayed
from gyre.train.tree_attention import TreeMask


def no_decay(name: str, p: Tensor) -> bool:
    """Biases and norm weights take no weight decay (Megatron's default rule)."""
    return p.ndim == 1 or name.endswith(".bias")


class EmbeddedTrainer(Trainer):
    """Plain torch on the model: AdamW, clip-by-norm, one process.

    Parameters and optimizer state stay float32; `dtype=bfloat16` (the default on CUDA) runs the
    forward under autocast, i.e. mixed precision with fp32 master weights, as Megatron does.
    """

    def __init__(self, cfg: TrainConfig, model, *, device: str | torch.device | None = None,
                 attention: str = "tree") -> None:
        super().__init__(cfg)
        if attention not in ATTENTION_PATHS:
            raise ValueError(f"attention {attention!r}: choose one of {', '.join(ATTENTION_PATHS)}")
        self.attention = attention
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if isinstance(model, (str, os.PathLike)):
            model = lm_class(read_config(model)).from_dir(model)
        elif not isinstance(model, Qwen2LM):  # HybridLM is a Qwen2LM
            model = lm_class(model.config.to_dict()).from_transformers(model)
        check_model(cfg, len(model.spec.moe_layers))
        self.model = model.to(device=self.device, dtype=torch.float32)
        self.hf_config = model.config  # config.json as a dict: exported as read
        self.compute_dtype = torch_dtype(cfg.dtype)
        named = list(self.model.named_parameters())
        self.optimizer = torch.optim.AdamW(
            [{"params": [p for n, p in named if not no_decay(n, p)], "weight_decay": cfg.weight_decay},
             {"params": [p for n, p in named if no_decay(n, p)], "weight_decay": 0.0}],
            lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
        # torch's scheduler over the shared formula (gyre.train.lr_schedule); its position is set
        # from self.step in _set_lr, so a restored checkpoint continues the schedule
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.schedule.factor)
        if self.reg.needs_reference:  # the initial weights, frozen (float32, like the policy's master copy)
            self.reference = Reference({"model": copy.deepcopy(self.model)})
        self._stashes: dict[str, HostStash] = {}

    def _set_lr(self) -> None:
        # LambdaLR's last_epoch counts optimizer steps: each group's lr = its base lr x factor(step)
        if self.scheduler.last_epoch == self.step - 1 and getattr(self.optimizer, "_opt_called", False):
            self.scheduler.step()  # after an optimizer step, as torch documents
        elif self.scheduler.last_epoch != self.step:  # a restored step: resume the scheduler there
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.schedule.factor,
                                                               last_epoch=self.step - 1)

    def _moe_aux_loss(self):
        aux = self.model.moe_aux_loss()
        if aux is None:
            return None, None
        coef = self.cfg.moe_aux_loss_coef
        return (coef * aux if coef > 0 else None), float(aux.detach())

    def _mask(self, mb: MicroBatch):
        if self.attention == "tree" and mb.kv_end is not None:
            return TreeMask.build(mb.kv_end)  # once per micro-batch, shared by every layer
        return mb.dense_mask()  # bool, True = masked: the dense path (S x S, built here only)

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=self.compute_dtype,
                              enabled=self.compute_dtype != torch.float32)

    def _target_logprobs(self, mb: MicroBatch, entropy: list | None = None, token_entropy: bool = False) -> Tensor:
        self.model.train(torch.is_grad_enabled())
        with self._autocast():
            h = self.model.hidden(mb.input_ids, mb.position_ids, self._mask(mb), replayed(self.cfg, mb),
                                  recompute=self.cfg.recompute)
            return target_logprobs(rows_at(h, mb.pred_pos), self.model.lm_head, mb.target_ids,
                                   temperature=mb.temperature, chunk=self.cfg.logprob_chunk, entropy=entropy,
                                   token_entropy=token_entropy)

    def _logits(self, mb: MicroBatch) -> Tensor:
        self.model.train(torch.is_grad_enabled())
        with self._autocast():
            return self.model(mb.input_ids, mb.position_ids, self._mask(mb), routed_experts=replayed(self.cfg, mb))

    def _apply_gradients(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def _grad_params(self) -> list[Tensor]:
        return list(self.model.parameters())

    def _grad_views(self, create: bool) -> list[Tensor]:
        if create:
            for p in self.model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        return [p.grad for p in self.model.parameters()]

    def _apply_set_gradients(self) -> float:
        return self._apply_gradients()  # one process: nothing to reduce either way

    def clear_gradients(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)  # None, so offload has no grads to move
        self._reset_step_stats()

    def hf_state_dict(self) -> dict[str, Tensor]:
        sd = {k: v.detach() for k, v in self.model.state_dict().items()}
        if self.model.spec.tied:
            sd.pop("lm_head.weight", None)
        return sd

    def _optimizer_tensors(self) -> list[Tensor]:
        return [v for s in self.optimizer.state.values() for v in s.values()
                if isinstance(v, Tensor) and v.device == self.device]

    def offload(self) -> dict:
        if self._stashes:
            raise RuntimeError("already offloaded")
        self._check_between_steps()  # so there are no grads: the step set them to None
        timer, moved = PhaseTimer(), {}
        ref = self.reference.parameters() if self.reference is not None else []
        for phase, tensors in (("params", [*self.model.parameters(), *ref]),
                               ("optimizer", self._optimizer_tensors())):
            self._stashes[phase] = HostStash()
            with timer(phase):
                moved[phase] = self._stashes[phase].offload(tensors)
        return phase_timings(timer, moved)

    def restore(self) -> dict:
        if not self._stashes:
            raise RuntimeError("not offloaded")
        timer, moved = PhaseTimer(), {}
        for phase, stash in self._stashes.items():
            with timer(phase):
                moved[phase] = stash.restore()
        self._stashes.clear()
        return phase_timings(timer, moved)

    def _state(self) -> dict:
        return {"model": {k: v.cpu() for k, v in self.model.state_dict().items()},
                "optimizer": self.optimizer.state_dict()}

    def _load_state(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
