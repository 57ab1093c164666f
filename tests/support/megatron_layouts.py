"""Megatron trainers of the tiny qwen2 at tensor parallel 2 and pipeline parallel 2 (two spawned gloo
ranks) and in one process, saving and loading layout-free checkpoints: for
tests/train/test_megatron_layouts.py and benchmarks/bench_checkpoints.py."""

from __future__ import annotations

from pathlib import Path

import torch

from gyre.batch import expanded_batch, per_execution_weights
from gyre.config import TrainConfig

SEQS = [[1, 2, 3, 40, 41, 42, 43], [1, 2, 3, 50, 51], [9, 8, 60, 61, 62, 63, 64, 65], [9, 8, 70]]
PLENS = [3, 3, 2, 2]
ADV = [1.0, -1.0, 0.5, -0.5]
# a large Adam eps makes the first update ~ lr * grad instead of lr * sign(grad), so rounding-level
# gradient differences stay rounding-level in the parameters
CFG = dict(lr=1e-3, dtype="float32", adam_eps=1.0)


def batch():
    rows = range(len(SEQS))
    old = [[-4.0] * (len(SEQS[r]) - PLENS[r]) for r in rows]
    exe = torch.tensor([r for r in rows for _ in range(len(SEQS[r]) - PLENS[r])])
    return expanded_batch([SEQS[r] for r in rows], [PLENS[r] for r in rows], old_logprobs=old,
                          advantages=[ADV[r] for r in rows], execution_index=list(rows),
                          weights=per_execution_weights(exe, len(SEQS)))


def model(tied: bool = False):
    from gyre.train.toy import random_qwen2, tiny_qwen2_config

    hf = random_qwen2(tiny_qwen2_config(tie_word_embeddings=tied), seed=0, std=0.1)
    return hf, {k: v.numpy().copy() for k, v in hf.state_dict().items()}


def trainer(hf_config, hf_state: dict, **layout):
    from gyre.train.megatron_trainer import MegatronTrainer

    return MegatronTrainer(TrainConfig(**CFG, **layout), hf_config,
                           {k: torch.from_numpy(v) for k, v in hf_state.items()})


def numpy_state(state: dict) -> dict:
    """numpy arrays travel by value between processes; tensors go through shared memory that
    disappears with the process that made them."""
    return {k: (v.numpy().copy() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def saved(path: Path) -> dict:
    """The layout-free state a checkpoint directory holds (model and Adam moments, HF names)."""
    from gyre.train.base import CHECKPOINT_FILE

    return torch.load(Path(path) / CHECKPOINT_FILE, map_location="cpu", weights_only=False)["state"]


@torch.no_grad()
def logits(t, mb) -> torch.Tensor | None:
    """The batch's [B, S, V] logits with the whole vocabulary, on the last pipeline stage (None on
    the others). A hand-run two-stage forward under pipeline parallelism (the first stage's decoder
    output sent to the next, Megatron's `set_input_tensor`), since the trainer refuses to run one;
    vocabulary slices gathered over the tensor-parallel group."""
    from megatron.core import parallel_state as ps

    mask, model = mb.dense_mask(), t.model
    model.eval()
    if not ps.is_pipeline_first_stage():
        B, S = mb.input_ids.shape
        hidden = torch.empty(S, B, model.config.hidden_size)
        torch.distributed.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
    out = model(mb.input_ids, mb.position_ids, mask)
    if not ps.is_pipeline_last_stage():
        torch.distributed.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        return None
    if ps.get_tensor_model_parallel_world_size() > 1:
        parts = [torch.empty_like(out) for _ in range(ps.get_tensor_model_parallel_world_size())]
        torch.distributed.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
        out = torch.cat(parts, dim=-1)
    return out


def world(layout: dict) -> int:
    """Ranks for a layout: tensor x pipeline x expert (the dense layers' data parallelism is the
    expert-parallel size; each rank takes the whole batch, so only checkpoints are compared there)."""
    return layout.get("tensor_parallel", 1) * layout.get("pipeline_parallel", 1) * layout.get("expert_parallel", 1)


def layout_rank(layout: dict, load: Path | None, save: Path | None, step: bool,
                rank, port, hf_config, hf_state, out):
    """One of the gloo ranks (`world`) at ``layout`` (e.g. ``{"tensor_parallel": 2}``): load ``load``, take
    a step on the whole batch when ``step``, save ``save``; rank 0 replies (step, the whole model
    in HF names, the batch's logits, the step's stats or None, rank 0's own parameter shapes)."""
    from gyre.train.dist import init_distributed

    torch.set_num_threads(1)
    init_distributed(rank=rank, world_size=world(layout), init_method=f"tcp://127.0.0.1:{port}")
    t = trainer(hf_config, hf_state, **layout)
    if load is not None:
        t.load_checkpoint(load)
    if layout.get("pipeline_parallel", 1) > 1:
        try:
            t.forward_backward(batch())
            raise AssertionError("a forward at a pipeline stage ran")
        except NotImplementedError:
            pass  # the trainer refuses: it has no pipeline schedule
    if step:
        stats = t.forward_backward(batch())
        stats |= t.optimizer_step()
    if save is not None:
        t.save_checkpoint(save)  # every rank takes part
    whole = t.hf_state_dict()  # collective
    lg = logits(t, batch())
    every: list = [None] * world(layout)
    torch.distributed.all_gather_object(every, None if lg is None else lg.numpy().copy())
    if rank == 0:
        own = {n: tuple(p.shape) for n, p in t.model.named_parameters()}  # what a rank-0 save of its model held
        out.put((t.step, numpy_state(whole), next(x for x in every if x is not None), stats if step else None, own))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
