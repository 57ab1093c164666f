"""The trainer interface the rest of Gyre uses, and what every backend shares.

One seam, several backends (ARCHITECTURE.md invariant 7), picked by name from
`gyre.train.backends.BACKENDS`: the embedded torch trainer (gyre.train.trainer) for one machine,
Megatron-Core (gyre.train.megatron_trainer) for clusters. A step is

    for mb in micro_batches: trainer.forward_backward(mb)   # gradients accumulate (loss is a sum)
    trainer.optimizer_step()                                # clip, update, zero grads, step += 1

or, with PPO-style updates inside the step, ``trainer.train_step(micro_batches, minibatches)``.

Backends import this module; it imports no backend, and backends do not import each other.
"""

from __future__ import annotations

import copy
import os
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from gyre.batch import MicroBatch
from gyre.config import TrainConfig
from gyre.minibatch import minibatch_parts, minibatch_scales
from gyre.train.export import save_torch_atomic, write_hf_weights
from gyre.train.loss import OffPolicy, Regularizers, policy_loss_from_logprobs
from gyre.train.lr_schedule import LrSchedule
from gyre.train.offload import PhaseTimer
from gyre.train.reference import Reference
from gyre.train.step_stats import merge, summarize

ATTENTION_PATHS = ("tree", "dense")  # tree: work follows kv_end (tree_attention); dense: S x S mask

CHECKPOINT_FILE = "trainer.pt"
_MEAN_STATS = ("ratio_mean", "clip_frac", "logp_mean", "kl_old", "entropy", "kl_ref")  # averaged over targets


def torch_dtype(name: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


class Trainer(ABC):
    """Backend-independent part: loss, step statistics, export and checkpoint files."""

    hf_config: dict | object  # config.json: a dict, or a transformers config (Megatron)
    device: torch.device

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.off_policy = OffPolicy.from_config(cfg)
        self.reg = Regularizers.from_config(cfg)
        self.schedule = LrSchedule.from_config(cfg)
        self.reference: Reference | None = None  # built by the backend when reg.needs_reference
        self.step = 0
        self.update = 0  # optimizer updates applied inside the open step (train.minibatches_per_step)
        self._reset_step_stats()

    # --- backend hooks ---------------------------------------------------------------------
    @abstractmethod
    def _target_logprobs(self, mb: MicroBatch, entropy: list | None = None, token_entropy: bool = False) -> Tensor:
        """float32 log-probs [T] of the micro-batch's targets under the current policy, from the
        hidden states at `pred_pos` in chunks of `train.logprob_chunk` (gyre.train.logprobs):
        never the [B, S, V] logits. `entropy`: a list to receive each chunk's entropy sum, or with
        `token_entropy` each chunk's per-target entropies with gradient (the entropy bonus)."""

    @abstractmethod
    def _set_lr(self) -> None:
        """Point the optimizer's learning rate at the next update's, `self.schedule` after
        `self.step` optimizer steps (at construction, after each step, after a checkpoint load)."""

    @torch.no_grad()
    def reference_logprobs(self, mb: MicroBatch) -> Tensor:
        """The frozen reference's log-probs [T] of the micro-batch's targets (gyre.train.reference),
        by the same chunked forward as the policy's."""
        if self.reference is None:
            raise RuntimeError("no reference model: train.kl_coef is 0")
        with self.reference.standing_in(self):
            return self._target_logprobs(mb)

    @abstractmethod
    def _logits(self, mb: MicroBatch) -> Tensor:
        """[B, S, V] logits of the current policy: the dense reference for tests, not training."""

    @abstractmethod
    def _apply_gradients(self) -> float:
        """Reduce, clip and apply the accumulated gradients, zero them; returns the grad norm."""

    @abstractmethod
    def hf_state_dict(self) -> dict[str, Tensor]:
        """The current weights in transformers naming and layout."""

    @abstractmethod
    def offload(self) -> dict:
        """Release accelerator memory (params, grads, optimizer state) between steps; returns
        seconds per phase (`params_s`, `grads_s`, `optimizer_s`, `total_s`) and `bytes` moved."""

    @abstractmethod
    def restore(self) -> dict:
        """Undo `offload` bit-identically; returns timings like `offload`."""

    def _check_between_steps(self) -> None:
        # gradients of a half-done step are not carried over a role switch
        if self._acc["micro_batches"]:
            raise RuntimeError("offload only between steps: call optimizer_step() first")

    @abstractmethod
    def _state(self) -> dict:
        """Model and optimizer state for a checkpoint."""

    @abstractmethod
    def _load_state(self, state: dict) -> None: ...

    @property
    def rank(self) -> int:
        return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    def _barrier(self) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    # --- training ---------------------------------------------------------------------------
    def _reset_step_stats(self) -> None:
        self._acc = {"loss": 0.0, "targets": 0, "tokens": 0, "micro_batches": 0, "fwd_bwd_s": 0.0,
                     **{k: 0.0 for k in _MEAN_STATS}}
        self._mb_stats: list[dict] = []  # the step's micro-batch stats, for the mismatch summary

    @property
    def pending_micro_batches(self) -> int:
        """Micro-batches whose gradients are accumulated and not yet applied or cleared."""
        return self._acc["micro_batches"]

    def forward_backward(self, mb: MicroBatch, prox: Tensor | None = None) -> dict:
        """Loss and gradients of one micro-batch, added to the gradients of the step so far.

        `prox`: pi_prox of its targets when the weights moved since the step's start (a later
        minibatch of `train_step`; a live step carries it as `mb.prox_logprobs`); None: they did
        not, and pi_prox is this forward's own value, so no extra forward runs."""
        t0 = time.perf_counter()
        mb = mb.to(self.device)
        if prox is None:
            prox = mb.prox_logprobs
        ref, ref_s = None, 0.0
        if self.reference is not None:  # before the policy's forward: its activations are not held yet
            t_ref = time.perf_counter()
            ref = self.reference_logprobs(mb)
            ref_s = time.perf_counter() - t_ref
        ent: list = []  # the targets' entropy, chunk by chunk (no second pass)
        bonus = self.reg.entropy_coef > 0  # per target, with gradient
        logp = self._target_logprobs(mb, entropy=ent, token_entropy=bonus)
        loss, stats = policy_loss_from_logprobs(logp, mb, self.cfg.clip_low, self.cfg.clip_high,
                                                clip=self.cfg.clip, staleness_weights=self.cfg.staleness_weights,
                                                off_policy=self.off_policy, prox_logprobs=prox,
                                                entropy=None if bonus or not ent else sum(ent), reg=self.reg,
                                                ref_logprobs=ref,
                                                token_entropy=torch.cat(ent) if bonus and ent else None)
        if ref is not None:  # its cost, merged over micro-batches and cells (gyre.train.step_stats)
            stats.update(ref_time_sum=ref_s, ref_bytes_max=self.reference.nbytes)
        extra, aux = self._moe_aux_loss()
        if extra is not None:
            loss = loss + extra
        loss.backward()
        if aux is not None:
            stats["moe_aux_loss"] = aux
            self._acc["moe_aux_loss"] = self._acc.get("moe_aux_loss", 0.0) + aux
        stats["fwd_bwd_s"] = time.perf_counter() - t0
        self._mb_stats.append(stats)
        a = self._acc
        for k in ("loss", "targets", "tokens", "fwd_bwd_s"):
            a[k] += stats[k]
        if "ref_time_sum" in stats:
            a["ref_time_sum"] = a.get("ref_time_sum", 0.0) + stats["ref_time_sum"]
        for k in _MEAN_STATS:
            if stats.get(k) is not None:  # entropy: None where the backend cannot tell it; kl_ref: off
                a[k] += stats[k] * stats["targets"]
        a["micro_batches"] += 1
        return stats

    def _moe_aux_loss(self) -> tuple[Tensor | None, float | None]:
        """After a forward: (term to add to the loss, or None; the load-balancing loss summed over
        MoE layers, unweighted, for the logs, or None for a dense model)."""
        return None, None

    def optimizer_step(self) -> dict:
        """Apply the step's gradients; returns the step's statistics including grad_norm."""
        t0 = time.perf_counter()
        return self._finish_step(self._apply_gradients(), t0)

    def train_step(self, micro_batches: Sequence[MicroBatch], minibatches: int = 1) -> dict:
        """One step as PPO-style updates (`train.minibatches_per_step`): the micro-batches in
        `minibatches` consecutive parts, one optimizer update each, the step counted once.

        pi_prox is the weights at the step's start for every part: the first part trains before
        any update (pi_prox = pi_theta, no extra forward); the later parts' pi_prox comes from one
        no-grad forward before the first update, so their clip and importance weights act on how
        far the earlier updates moved the policy. Each part's loss weights are rescaled to sum to
        the step's, so every update is a mean over its own tokens."""
        mbs = list(micro_batches)
        parts = minibatch_parts(mbs, minibatches)
        n = len(parts)
        prox = [[None] * len(p) if i == 0 else [self.logprobs(mb) for mb in p] for i, p in enumerate(parts)]
        scales = minibatch_scales([sum(float(mb.weights.sum()) for mb in part) for part in parts])
        norms = []
        for i, (part, part_prox, scale) in enumerate(zip(parts, prox, scales)):
            for mb, p in zip(part, part_prox):
                if scale != 1.0:
                    mb = copy.copy(mb)
                    mb.weights = mb.weights * scale
                self.forward_backward(mb, p)
            if i < n - 1:
                norms.append(self._apply_gradients())  # an update inside the step: step not counted
                self.update += 1
        out = self.optimizer_step()
        out.update(minibatches=n, minibatch_grad_norms=[*norms, out["grad_norm"]])
        return out

    # --- gradients reduced outside the trainer (cells summing over MPI) ----------------------
    @abstractmethod
    def _grad_views(self, create: bool) -> list[Tensor]:
        """One float32 gradient tensor per parameter, in a fixed order that is the same in every
        replica; None where a parameter has no gradient yet, unless `create` (then zeros)."""

    @abstractmethod
    def _apply_set_gradients(self) -> float:
        """Clip and apply gradients that `set_flat_grads` wrote (no reduction), zero them;
        returns the grad norm."""

    def flat_grads(self) -> Tensor:
        """This step's accumulated gradients as one flat float32 CPU vector (zeros if none)."""
        parts = [g.detach().reshape(-1).float().cpu() if g is not None else torch.zeros(n)
                 for g, n in zip(self._grad_views(False), self._param_sizes())]
        return torch.cat(parts) if parts else torch.zeros(0)

    def num_grad_elements(self) -> int:
        return sum(self._param_sizes())

    def set_flat_grads(self, vec: Tensor) -> None:
        """Replace the accumulated gradients with `vec` (the layout of `flat_grads`)."""
        vec = torch.as_tensor(vec)
        if vec.ndim != 1 or vec.numel() != self.num_grad_elements():
            raise ValueError(f"flat gradients have shape {tuple(vec.shape)}; this model needs "
                             f"({self.num_grad_elements()},)")
        off = 0
        for g in self._grad_views(True):
            n = g.numel()
            g.copy_(vec[off:off + n].view_as(g))
            off += n

    def apply_gradients(self, final: bool = True) -> dict:
        """`optimizer_step` for gradients set with `set_flat_grads` (already summed over every
        replica of the step, so no data-parallel reduction runs here). ``final`` False: an update
        inside the step (a minibatch of `train.minibatches_per_step`): the weights move, the step
        is not counted and `update` goes up."""
        t0 = time.perf_counter()
        grad_norm = self._apply_set_gradients()
        if not final:
            self.update += 1
            self._reset_step_stats()
            return {"step": self.step, "update": self.update, "grad_norm": grad_norm}
        return self._finish_step(grad_norm, t0)

    @abstractmethod
    def clear_gradients(self) -> None:
        """Drop this step's gradients and statistics (after handing them elsewhere); the
        trainer is then between steps, so `offload` works."""

    @torch.no_grad()
    def own_storage(self) -> int:
        """Give every parameter and optimizer tensor a storage `offload` can release.

        Weights memory-mapped by transformers and tensors from `torch.load` have fixed-size
        storages, which `HostStash` cannot shrink; each such storage is copied once and its
        tensors (views included) moved onto the copy in place, so every reference stays valid.
        Returns the number of storages copied. Call after construction and `load_checkpoint`.
        """
        copies: dict[int, torch.UntypedStorage] = {}
        for t in [*self.model.parameters(), *self._optimizer_tensors()]:
            st = t.untyped_storage()
            if st.resizable() or st.nbytes() == 0:
                continue
            new = copies.setdefault(st.data_ptr(), st.clone())
            t.set_(new, t.storage_offset(), t.size(), t.stride())
        return len(copies)

    def _param_sizes(self) -> list[int]:
        return [p.numel() for p in self._grad_params()]

    @abstractmethod
    def _grad_params(self) -> list[Tensor]:
        """The parameters `_grad_views` follows, same order."""

    def _finish_step(self, grad_norm: float, t0: float) -> dict:
        self.step += 1
        self.update = 0
        a = self._acc
        out = {k: a[k] for k in ("loss", "targets", "tokens", "micro_batches", "fwd_bwd_s")}
        out.update({k: a[k] / max(a["targets"], 1) for k in _MEAN_STATS})
        if self.reference is None:
            out.pop("kl_ref")
        else:  # its cost: bytes held, share of the step's forward-and-backward time
            out.update(ref_memory_bytes=self.reference.nbytes, ref_time_s=a.get("ref_time_sum", 0.0))
        merged = merge(self._mb_stats, parallel=False)
        out.update(summarize(merged), prox_drift_max=merged.get("prox_drift_max"))
        if "moe_aux_loss" in a:  # mean over the step's micro-batches
            out["moe_aux_loss"] = a["moe_aux_loss"] / max(a["micro_batches"], 1)
        out.update(step=self.step, grad_norm=grad_norm, optimizer_s=time.perf_counter() - t0,
                   off_policy=self.off_policy.mode, lr=self.schedule.lr_at(self.step))
        self._reset_step_stats()
        self._set_lr()  # the next step's rate
        return out

    @torch.no_grad()
    def logprobs(self, mb: MicroBatch) -> Tensor:
        """Current log-probs of the micro-batch's targets (float32, on the CPU)."""
        mb = mb.to(self.device)
        return self._target_logprobs(mb).cpu()

    # --- files ------------------------------------------------------------------------------
    def export_weights(self, out_dir: str | os.PathLike, weight_version: int | str) -> Path:
        """Write the weights in transformers layout (config.json + model.safetensors) atomically."""
        state = self.hf_state_dict()
        if self.rank == 0:
            write_hf_weights(out_dir, state, self.hf_config, weight_version)
        self._barrier()
        return Path(out_dir)

    def save_checkpoint(self, path: str | os.PathLike) -> Path:
        """Model, optimizer, step and RNG state; replaces `path` atomically."""
        payload = {"step": self.step, "update": self.update, "state": self._state(), "rng": torch.get_rng_state(),
                   "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
        if self.rank == 0:  # every rank holds the whole state after the collective _state() (any layout): one file
            save_torch_atomic(path, payload, filename=CHECKPOINT_FILE)
        self._barrier()
        return Path(path)

    def load_checkpoint(self, path: str | os.PathLike, *, as_start: bool = False) -> None:
        """Model, optimizer, step and RNG state of ``path``; ``as_start``: model and optimizer only,
        at step 0 (a new run from trained weights with the optimizer carried, model.init_optimizer)."""
        payload = torch.load(Path(path) / CHECKPOINT_FILE, map_location="cpu", weights_only=False)
        self._load_state(payload["state"])
        if as_start:
            self.step, self.update = 0, 0
            self._reset_step_stats()
            return
        self.step = payload["step"]
        self.update = payload.get("update", 0)  # checkpoints written before minibatch updates: 0
        self._set_lr()  # the schedule follows the restored optimizer step
        torch.set_rng_state(payload["rng"])
        if payload["cuda_rng"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(payload["cuda_rng"])
        self._reset_step_stats()


def phase_timings(timer: PhaseTimer, moved: dict) -> dict:
    out = {f"{k}_s": v for k, v in timer.times.items()}
    out["total_s"] = sum(timer.times.values())
    out["bytes"] = sum(moved.values())
    return out


