"""Where every number of a simulated preset comes from: hardware, model arithmetic, the paper.

A preset is a workload profile, a model, a GPU and a layout. The cluster model's rates are derived
here from stated sources, never fitted to an end-to-end time the benchmark then reports:

- training throughput: FLOP arithmetic (8 x active parameters + causal attention per token: forward,
  backward and the behaviour log-prob recomputation) at a stated MFU;
- decode: processor sharing with a knee (``half_load``) from the number of serving replicas per
  cell and a per-replica batch knee (assumed), and durations that hold at the load the preset's own
  E0 run serves (``ref_load``: the only quantity computed from a simulation, and from the load, not
  from a headline time);
- re-prefill of a lost KV cache: prefill FLOPs of the call's context on one replica;
- memory: training state (16 bytes/parameter with Adam) must fit a cell, FP8 serving weights a
  replica, or the layout is refused with the numbers.

``calibration(preset)`` returns ``{name: {value, source, fitted_on}}`` for nl2repo.json and the docs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from gyre.config import ConfigError
from gyre.sim.cluster import ClusterModel
from gyre.sim.workload import DURATION_SCALE_2P4T, NL2REPO, NL2REPO_2P4T, LognormalPreset

# Assumptions shared by every preset (each is varied in the sensitivity study).
TRAIN_MEM_SHARE = 0.8    # share of HBM the training state may take; the rest: activations, buffers
SERVE_MEM_SHARE = 0.7    # share of a replica's HBM the weights may take; the rest: KV cache
KNEE_PER_REPLICA = 8.0   # calls per replica where a decode step's per-call cost equals its fixed cost
KEEP_SOLO_SPEED = 0.8    # E sizes rollout so each call keeps >= this share of its solo decode speed
PREFILL_MFU = 0.4        # prefill is compute-bound; assumed MFU


@dataclass(frozen=True)
class Hardware:
    name: str
    hbm_gb: float
    bf16_tflops: float   # dense
    gpus_per_node: int = 8


# NVIDIA H200 SXM datasheet: 141 GB HBM3e, 4.8 TB/s, 989 TFLOPS dense BF16 (1,979 with sparsity).
H200 = Hardware("H200", 141.0, 989.0)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params: float              # total parameters
    active: float              # parameters active per token (MoE)
    attn_layers: int           # layers with full (quadratic) attention
    attn_dim: int              # heads x head dim of those layers
    replica_gpus: int          # GPUs per serving replica (SGLang tensor/expert parallel group)
    train_bytes_per_param: float = 16.0   # bf16 weights + fp32 master + Adam moments + grads
    serve_bytes_per_param: float = 1.0    # FP8 serving weights
    sources: dict = field(default_factory=dict, compare=False)

    def train_flops_per_token(self, seq: float) -> float:
        """Forward 2N + causal attention 2 L d S per token; training = forward + backward (3x) +
        the recomputation of behaviour log-probs (1x) = 4x forward."""
        return 4 * (2 * self.active + 2 * self.attn_layers * self.attn_dim * seq)

    @property
    def prefill_ctx_half(self) -> float:
        """Context at which attention doubles the per-token prefill cost."""
        return self.active / (self.attn_layers * self.attn_dim)


# Qwen3.5-122B-A10B (the paper's "Qwen 3.6 122B" is assumed to share its architecture): 122B total,
# 10B active, 48 layers of which every fourth has full attention (the rest Gated DeltaNet), 32 heads.
QWEN_122B = ModelSpec(
    "122B-A10B", params=122e9, active=10e9, attn_layers=12, attn_dim=32 * 256, replica_gpus=2,
    sources={"params": "Qwen3.5-122B-A10B model card (vultr/NVIDIA docs): 122B total, 10B active",
             "attn_layers": "model card: 48 layers, full attention every fourth (12)",
             "attn_dim": "assumed: 32 heads x 256 head dim (Qwen3-Next's head size)",
             "replica_gpus": "NVIDIA Dynamo recipe for Qwen3.5-122B-A10B on H200: FP8, TP2 per replica"})

# The 2.4T model: nothing but the size is published. Assumed: ~4% active like Qwen3.5-397B-A17B.
MODEL_2P4T = ModelSpec(
    "2.4T", params=2.4e12, active=100e9, attn_layers=24, attn_dim=128 * 128, replica_gpus=32,
    sources={"params": "paper: 2.4T parameters",
             "active": "assumed: 100B active (~4%, Qwen3.5-397B-A17B activates 4.3%)",
             "attn_layers": "assumed: 24 full-attention layers", "attn_dim": "assumed: 128 heads x 128",
             "replica_gpus": "computed: FP8 weights 2.4 TB over <= 70% of 141 GB needs 25 GPUs: 32 (4 nodes)"})


def train_state_tb(m: ModelSpec) -> float:
    return m.params * m.train_bytes_per_param / 1e12


def min_cell_nodes(m: ModelSpec, hw: Hardware = H200) -> int:
    """Smallest cell whose HBM holds the training state and one serving replica."""
    per_node = hw.gpus_per_node * hw.hbm_gb * TRAIN_MEM_SHARE / 1e3  # TB
    return max(math.ceil(train_state_tb(m) / per_node - 1e-9), math.ceil(m.replica_gpus / hw.gpus_per_node))


def check_layout(m: ModelSpec, cell_nodes: int, hw: Hardware = H200) -> None:
    """Refuse a cell that cannot hold the model's training state or a serving replica, with numbers."""
    gpus = cell_nodes * hw.gpus_per_node
    state = train_state_tb(m)
    room = gpus * hw.hbm_gb * TRAIN_MEM_SHARE / 1e3
    if state > room + 1e-9:
        raise ConfigError(
            f"a {cell_nodes}-node cell cannot train the {m.name} model: its training state is "
            f"{m.params / 1e9:g}B params x {m.train_bytes_per_param:g} bytes = {state:.1f} TB, but "
            f"{gpus} x {hw.hbm_gb:g} GB {hw.name} x {TRAIN_MEM_SHARE:.0%} usable = {room:.2f} TB; "
            f"use cells of at least {min_cell_nodes(m, hw)} nodes")
    weights = m.params * m.serve_bytes_per_param / 1e12
    if m.replica_gpus > gpus:
        raise ConfigError(f"a {cell_nodes}-node cell ({gpus} GPUs) cannot host one {m.name} serving "
                          f"replica of {m.replica_gpus} GPUs ({weights:.2f} TB of FP8 weights)")


def train_tokens_per_s(m: ModelSpec, cell_nodes: int, mfu: float, seq: float, hw: Hardware = H200) -> float:
    gpus = cell_nodes * hw.gpus_per_node
    return gpus * hw.bf16_tflops * 1e12 * mfu / m.train_flops_per_token(seq)


def prefill_tokens_per_s(m: ModelSpec, hw: Hardware = H200) -> float:
    """Short-context prefill rate of one replica (2N FLOPs per token at PREFILL_MFU)."""
    return m.replica_gpus * hw.bf16_tflops * 1e12 * PREFILL_MFU / (2 * m.active)


def execs_per_cell(c: ClusterModel, model_share: float, keep: float = 0.0) -> float:
    """E's sizing from the decode model: the most executions one cell serves while each call keeps
    KEEP_SOLO_SPEED of its solo speed: speed(L)/speed(1) = (1 + h)/(L + h) >= keep."""
    h = c.half_load * c.scale
    calls = (1 + h) / (keep or KEEP_SOLO_SPEED) - h
    return max(1.0, calls / max(model_share, 1e-6)) / c.scale


@dataclass(frozen=True)
class Preset:
    name: str
    workload: LognormalPreset
    model: ModelSpec
    nodes: int
    cell_nodes: int
    steps: int
    groups_per_step: int
    mfu: float
    ref_load: float            # calls per cell the preset's E0 run serves (computed, see below)
    push_s: float = 60.0
    opt_s: float = 5.0
    eval_s: float = 60.0
    to_train_s: float = 8.52
    to_rollout_s: float = 3.46
    hw: Hardware = H200
    notes: dict = field(default_factory=dict, compare=False)

    @property
    def half_load(self) -> float:
        return self.cell_nodes * self.hw.gpus_per_node / self.model.replica_gpus * KNEE_PER_REPLICA

    def cluster(self, **over) -> ClusterModel:
        check_layout(self.model, over.get("cell_nodes", self.cell_nodes), self.hw)
        m, w = self.model, self.workload
        base = dict(
            nodes=self.nodes, cell_nodes=self.cell_nodes, gpus_per_node=self.hw.gpus_per_node,
            ref_cell_nodes=self.cell_nodes, min_cell_nodes=1, half_load=self.half_load,
            ref_load=self.ref_load,
            train_tokens_per_s=train_tokens_per_s(m, self.cell_nodes, self.mfu, w.mean_context_tokens, self.hw),
            to_train_s=self.to_train_s, to_rollout_s=self.to_rollout_s, push_s=self.push_s, opt_s=self.opt_s,
            eval_s=self.eval_s, prefill_tokens_per_s=prefill_tokens_per_s(m, self.hw),
            prefill_ctx_half=m.prefill_ctx_half)
        return ClusterModel(**{**base, **over})

    def with_(self, **kw) -> "Preset":
        return replace(self, **kw)


# ref_load below is the time-weighted calls in flight per serving cell, as seen by a call, in the
# preset's own E0 run (python benchmarks/bench_nl2repo.py --calibrate iterates it to a fixed point).
P122B = Preset(
    name="nl2repo-122b-32n", workload=NL2REPO, model=QWEN_122B, nodes=32, cell_nodes=4, steps=24,
    groups_per_step=16, mfu=0.25, ref_load=22.7,
    notes={"steps": "paper: the 122B runs (DeepSWE, TerminalBench) train 24 steps; the 32-node "
                    "NL2Repo configuration's step count is not stated"})
P2P4T = Preset(
    name="nl2repo-2.4t", workload=NL2REPO_2P4T, model=MODEL_2P4T, nodes=384, cell_nodes=48, steps=48,
    groups_per_step=16, mfu=0.25, ref_load=18.3,
    notes={"nodes": "assumed: 8 cells of 48 nodes (3,072 H200); the paper does not state the cluster",
           "cell_nodes": "computed: 2.4T x 16 bytes = 38.4 TB of training state needs >= 43 nodes of "
                         "8 x 141 GB at 80%: cells of 48 nodes",
           "durations": f"assumed: the 122B profile x {DURATION_SCALE_2P4T:g} (no 2.4T profile is published)"})
PRESETS = {p.name: p for p in (P122B, P2P4T)}


def preset(name: str) -> Preset:
    if name in ("nl2repo",):
        return P122B
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None


def calibration(p: Preset) -> dict:
    """{name: {value, source, fitted_on}} for every number of the preset."""
    c = p.cluster()
    m, w, hw = p.model, p.workload, p.hw
    fl = m.train_flops_per_token(w.mean_context_tokens)

    def e(value, source, fitted_on=None):
        return {"value": value, "source": source, "fitted_on": fitted_on}

    prof = "paper's 122B workload profile: 1.93 h mean rollout, 2.96 h mean query, 9.51% >= 4 h"
    out = {
        "mean_duration_h": e(round(w.mean_duration_s / 3600, 3),
                             "paper (122B profile)" if p is P122B else p.notes.get("durations", "")),
        "sigma_task": e(w.sigma_task, "Monte Carlo fit of the profile's shape", prof),
        "sigma_exec": e(w.sigma_exec, "Monte Carlo fit of the profile's shape", prof),
        "group_size": e(w.group_size, "assumed: G = 8 rollouts per query (mean query = slowest of 8)"),
        "mean_calls": e(w.mean_calls, "paper: hundreds of model calls per execution"),
        "mean_tokens": e(w.mean_tokens, "paper: about 1M tokens processed per execution"),
        "mean_train_tokens": e(w.mean_train_tokens, "paper: 700K tokens per rollout (2.4T run)"),
        "mean_context_tokens": e(w.mean_context_tokens, "assumed: 128K at the end, linear growth = 64K "
                                 "mean, NVIDIA Dynamo's agentic median input length for Qwen3.5-122B-A10B"),
        "model_share": e(w.model_share, "assumed: 80% of an execution's time waits on model calls"),
        "nodes": e(p.nodes, p.notes.get("nodes", "paper: 32 nodes")),
        "cell_nodes": e(p.cell_nodes, p.notes.get("cell_nodes", "paper: 8 cells of 4 nodes")),
        "steps": e(p.steps, p.notes.get("steps", "paper: 48 training steps")),
        "groups_per_step": e(p.groups_per_step, "assumed: 16 queries x 8 rollouts per step"),
        "model_params": e(m.params, m.sources.get("params", "")),
        "model_active_params": e(m.active, m.sources.get("active", m.sources.get("params", ""))),
        "attn_layers": e(m.attn_layers, m.sources.get("attn_layers", "")),
        "attn_dim": e(m.attn_dim, m.sources.get("attn_dim", "")),
        "replica_gpus": e(m.replica_gpus, m.sources.get("replica_gpus", "")),
        "gpu": e(f"{hw.name} {hw.hbm_gb:g} GB, {hw.bf16_tflops:g} TFLOPS BF16",
                 "NVIDIA H200 SXM datasheet (dense BF16)"),
        "mfu": e(p.mfu, "assumed: 25% for MoE RL training; Megatron-Core reports up to 47% MFU for "
                        "dense GPT-175B on H100 (NVIDIA Megatron-Core docs), MoE RL runs lower"),
        "train_flops_per_token": e(fl, "8 x active + 8 x attn_layers x attn_dim x mean context "
                                       "(fwd + bwd + log-prob recompute)"),
        "train_tokens_per_s": e(round(c.train_tokens_per_s), "FLOP arithmetic: cell GPUs x peak x MFU / "
                                "FLOPs per token"),
        "half_load": e(round(c.half_load, 2), f"replicas per cell ({p.cell_nodes * hw.gpus_per_node // m.replica_gpus}) "
                       f"x assumed knee of {KNEE_PER_REPLICA:g} calls per replica"),
        "ref_load": e(p.ref_load, "computed: calls in flight per serving cell, as a call sees it, in "
                      "this preset's own E0 run (fixed point; --calibrate)", "the preset's E0 load, no end-to-end time"),
        "execs_per_cell": e(round(execs_per_cell(c, w.model_share), 2),
                            f"derived: E keeps each call at >= {KEEP_SOLO_SPEED:.0%} of its solo decode speed"),
        "prefill_tokens_per_s": e(round(c.prefill_tokens_per_s), f"FLOP arithmetic: replica GPUs x peak x "
                                  f"{PREFILL_MFU:.0%} MFU / 2 x active"),
        "prefill_ctx_half": e(round(c.prefill_ctx_half), "active / (attn_layers x attn_dim)"),
        "to_train_s": e(p.to_train_s, "paper: 8.52 s rollout -> train"),
        "to_rollout_s": e(p.to_rollout_s, "paper: 3.46 s train -> rollout (includes the weight reload)"),
        "weight_reload_s": e(round(m.params * m.serve_bytes_per_param / (m.replica_gpus * 25e9), 2),
                             "check: FP8 weights per GPU at an assumed 25 GB/s host->device; inside the "
                             "paper's switch time"),
        "push_s": e(p.push_s, "assumed: weight push per rollout round (decoding pauses)"),
        "opt_s": e(p.opt_s, "assumed: optimizer step per training step"),
        "eval_s": e(p.eval_s, "assumed: evaluating a workspace (CPU side)"),
        "train_state_tb": e(round(train_state_tb(m), 2), "16 bytes/param (bf16 weights, fp32 master, Adam)"),
        "min_cell_nodes": e(min_cell_nodes(m, hw), f"computed: training state / ({TRAIN_MEM_SHARE:.0%} of a node's HBM)"),
        "async_rollout_cells": e(max(1, c.cells // 2), "assumed: half the cells (the paper does not say)"),
    }
    return out
