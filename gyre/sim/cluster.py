"""Cluster model: how fast cells decode and train, and what switching, weight pushes and a lost KV
cache cost. The mechanics only; a preset's numbers and their sources are in gyre/sim/calibration.py."""

from __future__ import annotations

from dataclasses import dataclass

from gyre.config import ConfigError


@dataclass(frozen=True)
class ClusterModel:
    nodes: int = 32
    cell_nodes: int = 4
    gpus_per_node: int = 8
    # Decode: a cell with load L concurrent calls gives each call a speed proportional to
    # 1 / (max(L, 1) + half_load): nearly flat below half_load, throughput-bound above it.
    half_load: float = 4.0
    # Per-cell concurrency under which the workload's durations were measured (a preset: the load
    # its own E0 run serves).
    ref_load: float = 16.0
    # Training tokens per second of one cell, streaming micro-batches (a preset: FLOP arithmetic).
    train_tokens_per_s: float = 10_000.0
    to_train_s: float = 8.52      # paper: rollout -> train switch
    to_rollout_s: float = 3.46    # paper: train -> rollout switch
    push_s: float = 60.0          # weight push, once per rollout round; rollout cells pause decoding
    eval_s: float = 60.0          # evaluating a finished execution's workspace (CPU side)
    # Optimizer step of every step (trainers busy, rollout unaffected); push_s above is paid once
    # per rollout round (steps_per_sync steps) and pauses decoding.
    opt_s: float = 0.0
    # A call moved off a cell that left rollout (or resumed after a colocate training phase) lost
    # its KV cache and re-prefills its context: c tokens cost c / prefill_tokens_per_s x
    # (1 + c / prefill_ctx_half) seconds on one serving replica (attention grows with context).
    # 0 = the KV cache is never lost (the cost is off).
    prefill_tokens_per_s: float = 0.0
    prefill_ctx_half: float = 1.0e5
    # A constant re-prefill per lost cache in reference-seconds (added to the above; legacy knob).
    reprefill_s: float = 0.0
    # Decode and training rates above are for a cell of ref_cell_nodes and scale linearly with
    # cell size. Below min_cell_nodes a cell is refused (presets check memory per model instead:
    # calibration.check_layout).
    ref_cell_nodes: int = 4
    min_cell_nodes: int = 2

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ConfigError(f"nodes must be >= 1, got {self.nodes}")
        if self.cell_nodes < 1:
            raise ConfigError(f"cell size must be >= 1 node, got {self.cell_nodes}")
        if self.cell_nodes < self.min_cell_nodes:
            raise ConfigError(f"cell size {self.cell_nodes} is below {self.min_cell_nodes} nodes, "
                              "the smallest cell that holds the trainer's state")
        if self.nodes % self.cell_nodes:
            raise ConfigError(f"cell size {self.cell_nodes} does not divide {self.nodes} nodes; "
                              f"choose one of {', '.join(map(str, divisors(self.nodes)))}")
        for name in ("half_load", "ref_load", "train_tokens_per_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("to_train_s", "to_rollout_s", "push_s", "eval_s", "reprefill_s", "opt_s",
                     "prefill_tokens_per_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 seconds, got {getattr(self, name)}")

    @property
    def cells(self) -> int:
        return self.nodes // self.cell_nodes

    @property
    def gpus_per_cell(self) -> int:
        return self.cell_nodes * self.gpus_per_node

    def speed(self, in_call: int, rollout_cells: int) -> float:
        """Model-time progress per second of one call, relative to the reference load."""
        if rollout_cells <= 0:
            return 0.0
        load = max(in_call / (rollout_cells * self.scale), 1.0)
        return (self.ref_load + self.half_load) / (load + self.half_load)

    @property
    def scale(self) -> float:
        """Throughput of one cell in reference cells."""
        return self.cell_nodes / self.ref_cell_nodes

    def train_rate(self, train_cells: int) -> float:
        """Training tokens per second of `train_cells` cells together."""
        return train_cells * self.scale * self.train_tokens_per_s

    @property
    def solo_speed(self) -> float:
        return self.speed(1, 1)

    def reprefill(self, context_tokens: float) -> float:
        """Seconds (at reference speed) to rebuild the KV cache of a call with this context."""
        t = self.reprefill_s
        if self.prefill_tokens_per_s > 0 and context_tokens > 0:
            t += context_tokens / self.prefill_tokens_per_s * (1 + context_tokens / self.prefill_ctx_half)
        return t


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
