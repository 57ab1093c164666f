"""The micro-batch contract between materialization (`gyre.traj`) and the trainer.

A row is either *expanded* (one trajectory, causal mask, positions 0..S-1) or *tree-packed*
(each unique token once, mask = tree ancestry, positions = depth). Targets are a flat list of
(pred_pos, target_id) pairs, because in a tree one position can predict several next tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields

import numpy as np
import torch
from torch import Tensor


# How `select_rows` carries each field: "row" fields are [B, ...] and follow the rows kept,
# "target" fields are [T] and follow the targets of those rows, "scalar" fields are copied.
# Every field must say which (a new one without it fails `select_rows` and its test).
ROW, TARGET, SCALAR = "row", "target", "scalar"


def _axis(kind: str, default=dataclasses.MISSING):
    return field(default=default, metadata={"axis": kind})


@dataclass
class MicroBatch:
    input_ids: Tensor = _axis(ROW)       # [B, S] long, padded with 0
    position_ids: Tensor = _axis(ROW)    # [B, S] long: tree depth (packed) or 0..S-1 (expanded)
    # [B, 1, S, S] bool, True = masked (Megatron convention), only for an arbitrary dense mask
    # (tests); materialized rows leave it None and carry `kv_end`, the same mask in O(S).
    attention_mask: Tensor | None = _axis(ROW)
    pred_pos: Tensor = _axis(TARGET)     # [T] long: flat index b*S+i of the position predicting each target
    target_ids: Tensor = _axis(TARGET)   # [T] long
    old_logprobs: Tensor = _axis(TARGET)  # [T] float: behaviour log-probs recorded by the engine
    advantages: Tensor = _axis(TARGET)   # [T] float
    weights: Tensor = _axis(TARGET)      # [T] float: 1/(unique targets of its execution)/(executions in step)
    staleness: Tensor = _axis(TARGET)    # [T] long: policy lag of the token (step version - its node's policy version)
    execution_index: Tensor = _axis(TARGET)  # [T] long
    # [T] float: the divisor of the logits at each target, the temperature its call was sampled
    # with (1 for greedy calls): the engine reports log_softmax(logits / T) as SGLang does.
    # A number is broadcast to every target; None means 1.
    temperature: Tensor | float | None = _axis(TARGET, None)
    # the structure of a row in O(S): query i sees key j iff j <= i < kv_end[b, j] (padding
    # keys: 0). Set by materialization for tree and expanded rows; None only with a dense mask.
    kv_end: Tensor | None = _axis(ROW, None)  # [B, S] long
    # routing replay (train.routing_replay): the experts the engine routed each position to,
    # [B, S, MoE layers, top_k] int16; -1 where not recorded (the trainer routes those itself)
    routed_experts: Tensor | None = _axis(ROW, None)
    # [T] float: pi_prox of each target, the weights at the step's start, for a later minibatch
    # of a live step (train.minibatches_per_step, decoupled); None: pi_prox is this forward's own
    prox_logprobs: Tensor | None = _axis(TARGET, None)

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, Tensor):
            t = 1.0 if self.temperature is None else float(self.temperature)
            self.temperature = torch.full(self.target_ids.shape, t, dtype=torch.float32)

    @property
    def num_targets(self) -> int:
        return int(self.target_ids.numel())

    @property
    def num_tokens(self) -> int:
        """Tokens computed by the forward pass: positions that attend to themselves (not padding)."""
        if self.kv_end is not None:
            return int((self.kv_end > torch.arange(self.kv_end.shape[1], device=self.kv_end.device)).sum())
        return int((~self.attention_mask[:, 0].diagonal(dim1=-2, dim2=-1)).sum())

    def dense_mask(self) -> Tensor:
        """The [B,1,S,S] bool mask (True = masked), built on demand from `kv_end` when not given:
        for the dense attention path and tests only (S^2 memory)."""
        return self.attention_mask if self.attention_mask is not None else mask_from_kv_end(self.kv_end)

    def to(self, device) -> "MicroBatch":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return MicroBatch(**{k: v.to(device) if isinstance(v, Tensor) else v for k, v in values.items()})

    def validate(self) -> None:
        """Shape and range checks; a bad batch fails here, not deep inside a forward pass."""
        B, S = self.input_ids.shape
        T = self.num_targets
        if self.position_ids.shape != (B, S):
            raise ValueError(f"position_ids {tuple(self.position_ids.shape)} do not match input_ids {(B, S)}")
        if self.attention_mask is None and self.kv_end is None:
            raise ValueError("a micro-batch needs kv_end (or, for a dense test mask, attention_mask)")
        if self.attention_mask is not None:
            if self.attention_mask.shape != (B, 1, S, S):
                raise ValueError(f"attention_mask {tuple(self.attention_mask.shape)} does not match "
                                 f"input_ids {(B, S)}")
            if self.attention_mask.dtype != torch.bool:
                raise ValueError("attention_mask must be bool (True = masked)")
        for name in ("pred_pos", "old_logprobs", "advantages", "weights", "staleness",
                     "execution_index", "temperature"):
            if getattr(self, name).shape != (T,):
                raise ValueError(f"{name} has shape {tuple(getattr(self, name).shape)}, expected ({T},)")
        if T and (int(self.pred_pos.min()) < 0 or int(self.pred_pos.max()) >= B * S):
            raise ValueError("pred_pos out of range")
        if self.kv_end is not None and tuple(self.kv_end.shape) != (B, S):
            raise ValueError(f"kv_end has shape {tuple(self.kv_end.shape)}, expected {(B, S)}")
        if self.routed_experts is not None and (self.routed_experts.ndim != 4
                                                or tuple(self.routed_experts.shape[:2]) != (B, S)):
            raise ValueError(f"routed_experts has shape {tuple(self.routed_experts.shape)}, expected "
                             f"({B}, {S}, MoE layers, top_k)")
        if self.prox_logprobs is not None and self.prox_logprobs.shape != (T,):
            raise ValueError(f"prox_logprobs has shape {tuple(self.prox_logprobs.shape)}, expected ({T},)")
        if T and float(self.temperature.min()) <= 0:
            raise ValueError(f"temperature must be > 0 at every target, got {float(self.temperature.min())}")


def select_rows(mb: MicroBatch, rows: Tensor | list[int]) -> MicroBatch | None:
    """The micro-batch restricted to ``rows`` (in that order), every field carried: row fields
    indexed, target fields kept for the targets of those rows (``pred_pos`` re-indexed), scalars
    copied. None when ``rows`` is empty. The one place rows of a micro-batch are selected (ranks
    of a cell, data-parallel groups)."""
    idx = torch.as_tensor(rows, dtype=torch.long)
    if idx.numel() == 0:
        return None
    B, S = mb.input_ids.shape
    row_of_target = mb.pred_pos // S
    new_row = torch.full((B,), -1, dtype=torch.long)
    new_row[idx] = torch.arange(len(idx))
    keep = new_row[row_of_target] >= 0
    values = {}
    for f in fields(mb):
        v, axis = getattr(mb, f.name), f.metadata.get("axis")
        if axis is None:
            raise TypeError(f"MicroBatch.{f.name} declares no axis (row, target or scalar): "
                            f"select_rows cannot carry it")
        if f.name == "pred_pos":
            v = new_row[row_of_target[keep]] * S + v[keep] % S
        elif v is None or axis == SCALAR:
            pass
        elif axis == ROW:
            v = v[idx.to(v.device)]
        else:
            v = v[keep.to(v.device)]
        values[f.name] = v
    return MicroBatch(**values)


def causal_kv_end(lengths: list[int], seq_len: int) -> Tensor:
    """[B,S] `kv_end` of causal rows: each real key is seen up to its row's end, padding never."""
    idx = torch.arange(seq_len)
    n = torch.tensor(lengths, dtype=torch.long)[:, None]
    return torch.where(idx[None, :] < n, n, torch.zeros_like(n))


def mask_from_kv_end(kv_end: Tensor) -> Tensor:
    """The [B,1,S,S] bool mask (True = masked) that `kv_end` stands for."""
    i = torch.arange(kv_end.shape[1], device=kv_end.device)
    allowed = (i[None, :] <= i[:, None])[None] & (i[None, :, None] < kv_end[:, None, :])
    return ~allowed[:, None]


def causal_mask(lengths: list[int], seq_len: int) -> Tensor:
    """[B,1,S,S] bool mask (True = masked): causal within each row, padding masked both ways."""
    idx = torch.arange(seq_len)
    allowed = idx[None, :] <= idx[:, None]
    rows = []
    for n in lengths:
        valid = idx < n
        rows.append(~(allowed & valid[None, :] & valid[:, None]))
    # fully masked padding rows are fine: Megatron fills with -10000 and the embedded trainer
    # with the dtype minimum, so their softmax is uniform, never NaN, and no target reads them
    return torch.stack(rows)[:, None]


def per_execution_weights(execution_index: Tensor, num_executions: int | None = None) -> Tensor:
    """Loss weights for a step: each execution's tokens average to 1/(executions in the step).

    `execution_index` lists the unique target tokens of the *whole step*, so a long execution
    gets the same total weight as a short one.
    """
    counts = torch.bincount(execution_index)
    n = num_executions if num_executions is not None else int((counts > 0).sum())
    return 1.0 / counts[execution_index].double() / n


def expanded_batch(sequences: list[list[int]], prompt_lens: list[int], *, old_logprobs: list[list[float]],
                   advantages: list[float], execution_index: list[int],
                   staleness: list[int] | None = None, temperature: float = 1.0,
                   weights: Tensor | None = None) -> MicroBatch:
    """An expanded micro-batch: one row per sequence, its tokens after `prompt_len` are targets.

    Used by tests, benchmarks and simple callers; trees go through `gyre.traj` instead.
    """
    B, S = len(sequences), max(map(len, sequences))
    ids = torch.zeros(B, S, dtype=torch.long)
    pred, tgt, old, adv, exe, stale = [], [], [], [], [], []
    for b, seq in enumerate(sequences):
        ids[b, :len(seq)] = torch.tensor(seq)
        for j, i in enumerate(range(prompt_lens[b], len(seq))):
            pred.append(b * S + i - 1)
            tgt.append(seq[i])
            old.append(old_logprobs[b][j])
            adv.append(advantages[b])
            exe.append(execution_index[b])
            stale.append(0 if staleness is None else staleness[b])
    exe_t = torch.tensor(exe, dtype=torch.long)
    mb = MicroBatch(
        input_ids=ids,
        position_ids=torch.arange(S).expand(B, S).clone(),
        attention_mask=None,
        pred_pos=torch.tensor(pred, dtype=torch.long),
        target_ids=torch.tensor(tgt, dtype=torch.long),
        old_logprobs=torch.tensor(old, dtype=torch.float32),
        advantages=torch.tensor(adv, dtype=torch.float32),
        weights=(per_execution_weights(exe_t) if weights is None else weights).float(),
        staleness=torch.tensor(stale, dtype=torch.long),
        execution_index=exe_t,
        temperature=temperature,
        kv_end=causal_kv_end([len(s) for s in sequences], S),
    )
    mb.validate()
    return mb


# --- wire format: a micro-batch as numpy arrays (MPI pickles, pipes to the trainer process) ----
# numpy, not torch: pickled torch tensors may travel through shared memory that dies with the
# sender; numpy arrays are copied by value.

def to_wire(mb: MicroBatch) -> dict:
    """``{field: np.ndarray}``; inverse of :func:`from_wire`.
    Fields that are None (``attention_mask`` of materialized rows, or ``kv_end``) are left out:
    a row travels as its O(S) ``kv_end``, never as an S x S mask."""
    out: dict = {}
    for f in fields(mb):
        v = getattr(mb, f.name)
        if v is not None:
            out[f.name] = v.detach().cpu().numpy()
    return out


def from_wire(d: dict) -> MicroBatch:
    """A validated MicroBatch from :func:`to_wire` output; a missing field is a clear error."""
    optional = [f.name for f in fields(MicroBatch) if f.default is not dataclasses.MISSING] + ["attention_mask"]
    names = [f.name for f in fields(MicroBatch)]
    missing = [n for n in names if n not in d and n not in optional]
    if missing:
        raise ValueError(f"micro-batch on the wire lacks {missing}")
    mb = micro_batch_of({n: d[n] for n in names if n in d})
    mb.validate()
    return mb


def micro_batch_of(arrays: dict) -> MicroBatch:
    """A MicroBatch over numpy arrays in wire form (no copy, no validation): how
    `gyre.traj.materialize` turns the arrays it builds (the head sends them as they are) into tensors."""
    values = {n: torch.from_numpy(np.ascontiguousarray(v)) for n, v in arrays.items()}
    values.setdefault("attention_mask", None)
    return MicroBatch(**values)
