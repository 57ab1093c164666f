"""Tensor- and pipeline-parallel shards of a Megatron-Core GPTModel state dict, both directions.

`gyre.model.megatron_names` maps checkpoint (transformers) names to the *whole* GPTModel of one
expert-parallel rank. Under tensor parallelism (TP) a rank holds a slice of most weights, under
pipeline parallelism (PP) a stage holds a slice of the layers, numbered from 0 on every stage.
`shard` cuts the whole model's state to this rank's; `unshard` is the collective inverse: every
rank gives its slices and gets the whole model back, in whole-model Megatron names.

Slices of the local layer spec (Megatron-Core 0.16.1, no sequence parallelism):

* column-parallel (dim 0): ``embedding.word_embeddings`` (vocab-parallel), ``output_layer``,
  ``linear_qkv`` (weights and biases; its rows are whole query groups, so a contiguous slice is
  ``num_query_groups / TP`` groups) and ``linear_fc1``, which under the gated linear unit is
  ``[gate; up]``: a rank holds its slice of the gate then its slice of the up projection;
* row-parallel (dim 1): ``linear_proj``, ``linear_fc2``;
* everything else (norms, the MoE router, the shared-expert gate) is whole on every rank.

Routed experts are split over the expert-tensor-parallel group (Megatron's default: the TP size),
the rest over the tensor-parallel group. Pipeline stages split the layers evenly (Megatron's
default); the embedding lives on the first stage, the final norm and the output layer on the last
(with tied embeddings the last stage's ``output_layer`` is a copy of the embedding, kept in step
by Megatron's embedding group: it is dropped when gathering and re-made when cutting).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import Tensor

from gyre.model.families import ModelFormatError

_COLUMN = ("embedding.word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias",
           "linear_fc1.weight")
_ROW = ("linear_proj.weight", "linear_fc2.weight")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


@dataclass(frozen=True)
class Layout:
    """This rank's place in the tensor, expert-tensor and pipeline groups."""

    tp_rank: int = 0
    tp_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    @classmethod
    def current(cls) -> Layout:
        """From Megatron's parallel state (the trivial layout when it is not initialised)."""
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            return cls()
        return cls(ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
                   ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(),
                   ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size())

    @property
    def trivial(self) -> bool:
        return self.tp_size == self.etp_size == self.pp_size == 1

    def layers(self, total: int) -> range:
        """The global ids of this stage's layers (Megatron's even split)."""
        if total % self.pp_size:
            raise ModelFormatError(f"{total} layers cannot be split evenly over pipeline_parallel={self.pp_size}; "
                                   f"choose a size that divides the layer count")
        per = total // self.pp_size
        return range(self.pp_rank * per, (self.pp_rank + 1) * per)

    @property
    def first(self) -> bool:
        return self.pp_rank == 0

    @property
    def last(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def split_dim(name: str) -> int | None:
    """The dimension a tensor-parallel rank slices `name` along (None: whole on every rank)."""
    if name.endswith(_COLUMN):
        return 0
    if name.endswith(_ROW):
        return 1
    return None


def _is_glu(name: str) -> bool:
    return name.endswith("linear_fc1.weight")


def _tp(name: str, layout: Layout) -> tuple[int, int]:
    """(rank, size) of the group that slices `name`: routed experts have their own."""
    if ".mlp.experts." in name:
        return layout.etp_rank, layout.etp_size
    return layout.tp_rank, layout.tp_size


def _slice(name: str, t: Tensor, rank: int, size: int) -> Tensor:
    dim = split_dim(name)
    if dim is None or size == 1:
        return t
    if t.shape[dim] % (2 * size if _is_glu(name) else size):
        raise ModelFormatError(f"{name} {tuple(t.shape)} cannot be split over tensor_parallel={size} along dim {dim}; "
                               f"choose a tensor-parallel size that divides it")
    if _is_glu(name):  # [gate; up] -> [gate slice; up slice]
        gate, up = t.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    return t.chunk(size, dim=dim)[rank]


def shard(mg_sd: dict[str, Tensor], num_layers: int, *, tied: bool, layout: Layout | None = None) -> dict[str, Tensor]:
    """The whole model's GPTModel state (global layer ids) -> this rank's: its stage's layers,
    renumbered from 0, each tensor its tensor-parallel slice."""
    layout = layout or Layout.current()
    if layout.trivial:
        return mg_sd
    mine = layout.layers(num_layers)
    out = {}
    for name, t in mg_sd.items():
        m = _LAYER.match(name)
        if m:
            i = int(m[1])
            if i not in mine:
                continue
            name = f"decoder.layers.{i - mine.start}.{m[2]}"
        elif name.startswith("embedding.") and not layout.first:
            continue
        elif name.startswith(("decoder.final_layernorm.", "output_layer.")) and not layout.last:
            continue
        out[name] = t
    if tied and layout.last and not layout.first:  # the last stage's copy of the embedding
        out["output_layer.weight"] = mg_sd["embedding.word_embeddings.weight"]
    return {n: _slice(n, t, *_tp(n, layout)).contiguous() for n, t in out.items()}


def _join(name: str, parts: list[Tensor]) -> Tensor:
    dim = split_dim(name)
    if _is_glu(name):
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(parts, dim=dim)


def unshard(mg_sd: dict[str, Tensor], *, tied: bool, num_layers: int,
            layout: Layout | None = None) -> dict[str, Tensor]:
    """Collective over the tensor, expert-tensor and pipeline groups (every rank of them calls
    it with its own state, the same names per stage): the whole model in GPTModel names with
    global layer ids, on every rank."""
    layout = layout or Layout.current()
    if layout.trivial:
        return mg_sd
    from megatron.core import parallel_state as ps

    out = {}
    for name in sorted(mg_sd):  # the same order on every rank of a stage
        t = mg_sd[name].detach().contiguous()
        rank, size = _tp(name, layout)
        if split_dim(name) is not None and size > 1:
            group = ps.get_expert_tensor_parallel_group() if ".mlp.experts." in name \
                else ps.get_tensor_model_parallel_group()
            parts = [torch.empty_like(t) for _ in range(size)]
            torch.distributed.all_gather(parts, t, group=group)
            t = _join(name, parts)
        out[name] = t.cpu()
    offset = layout.layers(num_layers).start
    out = {(f"decoder.layers.{int(m[1]) + offset}.{m[2]}" if (m := _LAYER.match(n)) else n): t for n, t in out.items()}
    if layout.pp_size > 1:
        stages: list = [None] * layout.pp_size
        torch.distributed.all_gather_object(stages, out, group=ps.get_pipeline_model_parallel_group())
        out = {}
        for stage, part in enumerate(stages):
            if tied and stage > 0:  # the first stage's embedding is the weight; the rest hold copies
                part.pop("output_layer.weight", None)
            out.update(part)
    return out
