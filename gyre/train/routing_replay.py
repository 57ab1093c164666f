"""Routing replay on the trainer side (``train.routing_replay``): which routing a forward uses.

Both forwards of a micro-batch (the no-grad pi_prox / pi_old one and the training one) replay the
experts the engine routed each position to (``MicroBatch.routed_experts``), so a token's
log-prob under the trainer differs from the engine's by the weights and numerics only, never by
a router that tipped the other way. Positions without recorded routing (-1) route freely.
"""

from __future__ import annotations

import logging

from torch import Tensor

log = logging.getLogger(__name__)
_warned = False


def check_model(cfg, moe_layers: int) -> None:
    """Refuse routing replay on a dense model, where it can mean nothing."""
    if cfg.routing_replay and not moe_layers:
        raise ValueError("train.routing_replay = true needs a Mixture-of-Experts model; this one is dense "
                         "(set train.routing_replay = false)")


def replayed(cfg, mb) -> Tensor | None:
    """The routing a forward of ``mb`` replays: its recorded experts when the option is on, else
    None (the model routes itself: behaviour unchanged)."""
    global _warned
    if not cfg.routing_replay:
        return None
    if mb.routed_experts is None and not _warned:
        _warned = True
        log.warning("train.routing_replay is on but a micro-batch carries no routed experts (recorded "
                    "without it, or an older shard): its tokens route freely")
    return mb.routed_experts
