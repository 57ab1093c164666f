"""The frozen reference policy of the KL penalty (`train.kl_coef` > 0): the initial weights.

Where: in every trainer rank, next to the policy it trains, on the same device. A backend builds
it once, in its constructor, from the weights it starts from (the run's model directory; a
trainer restored from a checkpoint still starts from there, so the reference stays the initial
weights across resumes and nothing of it is checkpointed). Its log-probs come from the backend's
own forward (`Trainer._target_logprobs`, chunked at the target positions: no S x vocab logits),
run with the reference's modules in place of the policy's, under no_grad: no activations kept,
no gradient buffers, no optimizer state.

What it costs: one more copy of the parameters (the embedded trainer keeps float32, 4 bytes a
parameter next to the policy's ~16 with AdamW; Megatron keeps the model dtype, 2 bytes in bf16
next to ~18 in mixed precision) and one more forward per micro-batch (about a third of a
forward-and-backward). `nbytes` and the step stats' `ref_time_s` measure both
(benchmarks/bench_loop_opt.py).
With kl_coef 0 none of this exists.
"""

from __future__ import annotations

from contextlib import contextmanager

from torch import nn


class Reference:
    """Frozen modules standing in, by attribute name, for a trainer's own during a forward."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.modules = modules
        seen: dict[int, int] = {}
        for m in modules.values():
            m.requires_grad_(False)
            m.eval()
            for p in m.parameters():
                seen[id(p)] = p.numel() * p.element_size()
        self.nbytes = sum(seen.values())  # distinct parameters: "model" and "ddp" may be one module

    def parameters(self) -> list:
        """Its distinct parameters (offload moves them with the policy's)."""
        out, seen = [], set()
        for m in self.modules.values():
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    @contextmanager
    def standing_in(self, owner):
        """`owner`'s attributes replaced by the reference's modules inside, restored after."""
        saved = {name: getattr(owner, name) for name in self.modules}
        try:
            for name, m in self.modules.items():
                setattr(owner, name, m)
            yield
        finally:
            for name, m in saved.items():
                setattr(owner, name, m)
