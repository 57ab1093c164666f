"""Cluster model: how fast cells decode and train, and what switching, weight pushes and a lost KV
cache cost. The mechanics only; a preset's numbers and their sources are in gyre/sim/calibration.py.

Decode is physical (``gyre.sim.roofline``): a rollout cell holds ``replicas`` serving replicas; the
calls decoding on the cluster spread evenly over the replicas of the serving cells, and each call
gains one token per decode step of its replica, whose time grows with the batch (weights and
experts touched, KV read). A replica never runs a batch below one call, so one call alone is as
fast as one call on each of a cell's replicas (the per-replica floor).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from gyre.config import ConfigError, SchedConfig
from gyre.sim.roofline import ReplicaSpec

# The decode knee: a cell "needs" as many calls as it decodes while each keeps this share of its
# solo speed (E's rollout sizing and the slack's spare capacity use it; assumed).
KEEP_SOLO_SPEED = 0.8

# A small replica for tests and toy clusters: a dense ~1B model on one GPU-like device. Stated,
# not measured; presets use their own specs (gyre/sim/calibration.py).
TOY_REPLICA = ReplicaSpec(gpus=1, hbm_gb=80.0, hbm_tb_s=2.0, peak_tflops=400.0, dense_gb=2.0, expert_gb=0.0,
                          kv_bytes_per_token=1.0e5, overhead_ms=2.0, active_params=1.0e9)


@dataclass(frozen=True)
class ClusterModel:
    nodes: int = 32
    cell_nodes: int = 4
    gpus_per_node: int = 8
    replica: ReplicaSpec = field(default=TOY_REPLICA)
    # Training tokens per second of one cell of this size, streaming micro-batches (a preset: FLOP
    # arithmetic at a stated MFU).
    # The defaults are config's ([sched]: the one source of cost defaults, as the policy's Hints).
    train_tokens_per_s: float = SchedConfig.train_tokens_per_s
    to_train_s: float = SchedConfig.to_train_s      # paper: rollout -> train switch
    to_rollout_s: float = SchedConfig.to_rollout_s  # paper: train -> rollout switch
    push_s: float = SchedConfig.push_s    # weight push, once per rollout round; rollout cells pause decoding
    eval_s: float = SchedConfig.eval_s      # evaluating a finished execution's workspace (CPU side)
    # Optimizer step of every step (trainers busy, rollout unaffected); push_s above is paid once
    # per rollout round (steps_per_sync steps) and pauses decoding.
    opt_s: float = 0.0
    # A cell smaller than this is refused (presets check memory per model instead:
    # calibration.check_layout).
    min_cell_nodes: int = 1
    # Prefix-cache capacity per replica in tokens; 0 = the replica's own (HBM left after weights).
    kv_tokens_per_replica: float = 0.0

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
        if self.gpus_per_node < 1:
            raise ConfigError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")
        if self.replicas < 1:
            raise ConfigError(f"a cell of {self.gpus_per_cell} GPUs cannot hold one replica of "
                              f"{self.replica.gpus} GPUs; use larger cells")
        if self.train_tokens_per_s <= 0:
            raise ConfigError(f"train_tokens_per_s must be positive, got {self.train_tokens_per_s}")
        for name in ("to_train_s", "to_rollout_s", "push_s", "eval_s", "opt_s", "kv_tokens_per_replica"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def cells(self) -> int:
        return self.nodes // self.cell_nodes

    @property
    def gpus_per_cell(self) -> int:
        return self.cell_nodes * self.gpus_per_node

    @property
    def replicas(self) -> int:
        """Serving replicas of one rollout cell."""
        return self.gpus_per_cell // self.replica.gpus

    def batch(self, decoding: float, rollout_cells: int) -> float:
        """Calls per busy replica: spread evenly, never below one on a replica that has any."""
        return max(decoding / (rollout_cells * self.replicas), 1.0)

    def token_rate(self, decoding: float, rollout_cells: int, context: float) -> float:
        """Tokens per second one decoding call gains with `decoding` calls on `rollout_cells` cells
        at mean context `context`."""
        if rollout_cells <= 0:
            return 0.0
        return 1.0 / self.replica.step_s(self.batch(decoding, rollout_cells), context)

    def token_rate_fn(self) -> Callable[[float, int, float], float]:
        """`token_rate` with the constants bound once (the simulator asks it at every event): the
        same floats."""
        step, reps = self.replica.step_fn(), self.replicas

        def rate(decoding: float, rollout_cells: int, context: float) -> float:
            if rollout_cells <= 0:
                return 0.0
            b = decoding / (rollout_cells * reps)
            return 1.0 / step(b if b > 1.0 else 1.0, context)

        return rate

    def calls_per_cell(self, context: float, keep: float = KEEP_SOLO_SPEED) -> float:
        """Calls one rollout cell decodes while each keeps `keep` of its solo decode speed at mean
        context `context` (step_s(1) / step_s(B) >= keep), over the cell's replicas."""
        rep, solo = self.replica, self.replica.step_s(1, context)
        b = 1.0
        # a hybrid model's replica holds at most its state pool's requests
        while b < 4096 and b * 1.02 <= rep.state_slots and solo / rep.step_s(b * 1.02, context) >= keep:
            b *= 1.02
        return b * self.replicas

    def prefill_s(self, tokens: float, context: float = 0.0) -> float:
        return self.replica.prefill_s(tokens, context)

    @property
    def kv_tokens_per_cell(self) -> float:
        per = self.kv_tokens_per_replica or self.replica.kv_capacity_tokens
        return per * self.replicas

    def train_rate(self, train_cells: int) -> float:
        """Training tokens per second of `train_cells` cells together."""
        return train_cells * self.train_tokens_per_s


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
