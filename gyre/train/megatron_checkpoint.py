"""Megatron checkpoints that do not depend on the parallel layout they were saved at.

A rank's GPTModel holds a shard: its slice of each split weight under tensor parallelism, its
stage's layers under pipeline parallelism, its own experts under expert parallelism. Here every
rank takes part in a save: the weights (the optimizer's fp32 masters) and Adam's two moments are
gathered over the tensor, pipeline and expert groups and turned into checkpoint (transformers)
names (`megatron_model.megatron_to_hf`, gyre/train/megatron_layout.py); the result is the whole
model, every parameter at its full shape, on every rank. A load does the reverse on every rank: it
cuts out its own slice, stage and experts (`megatron_model.hf_to_megatron`). So a checkpoint saved
at TP 2, PP 2 or EP 2 loads at 1, and the other way round.

Which rank writes: after the gather every rank holds the same whole state (data-parallel replicas
held it already), so global rank 0 alone writes the file (`Trainer.save_checkpoint`): one file, no
shard to reassemble. Before the gather, rank 0's state was one shard, which is what a rank-0 save
of the model's own state dict wrote. The cost is the whole model in each rank's host memory for
the write; at 100B+ scale Megatron-Core's `dist_checkpointing` (every rank writing its shards)
is the way (docs/checkpoints.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

FORMAT = "hf-names-v1"
MOMENTS = ("exp_avg", "exp_avg_sq")


def _pairs(trainer) -> list[tuple[Tensor, Tensor, object]]:
    """(model parameter, the parameter the optimizer steps, its torch optimizer) for every
    parameter: the fp32 master under bf16, the parameter itself in fp32."""
    out = []
    for opt in trainer._inner_optimizers():
        if hasattr(opt, "float16_groups"):  # Float16OptimizerWithFloat16Params
            for model_g, main_g, fp32_g in zip(opt.float16_groups, opt.fp32_from_float16_groups,
                                               opt.fp32_from_fp32_groups):
                out += [(p, m, opt.optimizer) for p, m in zip(model_g, main_g)]
                out += [(p, p, opt.optimizer) for p in fp32_g]
        else:
            out += [(p, p, opt.optimizer) for g in opt.optimizer.param_groups for p in g["params"]]
    return out


def _named(trainer) -> dict[str, tuple[Tensor, object]]:
    """Megatron name -> (the stepped parameter, its torch optimizer)."""
    name_of = {id(p): n for n, p in trainer.model.named_parameters()}
    return {name_of[id(p)]: (main, opt) for p, main, opt in _pairs(trainer) if id(p) in name_of}


def save_state(trainer) -> dict:
    """Collective over the expert-parallel group: the layout-free model and optimizer state."""
    from gyre.train.megatron_model import megatron_to_hf

    named = _named(trainer)
    state = {"format": FORMAT, "model": megatron_to_hf({n: m.detach().float().cpu() for n, (m, _) in named.items()},
                                                       trainer.hf_config)}
    steps = {int(opt.state[m]["step"]) for m, opt in named.values() if m in opt.state and "step" in opt.state[m]}
    if steps:  # every parameter has moments once a step ran (Adam's state is made for all at once)
        for key in MOMENTS:
            state[key] = megatron_to_hf({n: opt.state[m][key].detach().cpu() for n, (m, opt) in named.items()},
                                        trainer.hf_config)
        state["adam_step"] = max(steps)
    state["param_groups"] = [[{k: v for k, v in g.items() if k != "params"} for g in o.optimizer.param_groups]
                             for o in trainer._inner_optimizers()]
    return state


def load_state(trainer, state: dict) -> None:
    """This rank's part of a layout-free state: weights into the model (and the fp32 masters),
    the moments into Adam's state of the parameters this rank holds."""
    from gyre.train.megatron_model import hf_to_megatron

    named = _named(trainer)
    weights = hf_to_megatron(state["model"], trainer.hf_config)
    _check(weights, named)
    moments = {k: hf_to_megatron(state[k], trainer.hf_config) for k in MOMENTS if k in state}
    params = dict(trainer.model.named_parameters())
    with torch.no_grad():
        for n, (main, opt) in named.items():
            main.copy_(weights[n].to(main.dtype))
            if params[n] is not main:
                params[n].copy_(weights[n].to(params[n].dtype))
            opt.state.pop(main, None)
            if moments:
                opt.state[main] = {"step": torch.tensor(float(state["adam_step"])),
                                   **{k: moments[k][n].to(main.dtype).clone() for k in MOMENTS}}
    for o, groups in zip(trainer._inner_optimizers(), state.get("param_groups", [])):
        for g, saved in zip(o.optimizer.param_groups, groups):
            g.update({k: v for k, v in saved.items() if k in g})


def _check(weights: dict, named: dict) -> None:
    missing = sorted(set(named) - set(weights))
    if missing:
        raise KeyError(f"checkpoint mismatch: the model has {missing[:5]} ({len(missing)}) that the checkpoint lacks")
    for n, (main, _) in named.items():  # copy_ would broadcast some wrong shapes silently
        if tuple(weights[n].shape) != tuple(main.shape):
            raise ValueError(f"checkpoint mismatch: {n} is {tuple(weights[n].shape)} after cutting it for this "
                             f"rank's layout, the model's is {tuple(main.shape)}; was the checkpoint saved for "
                             f"another model config?")
