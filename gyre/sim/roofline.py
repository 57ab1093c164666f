"""A serving replica from bytes and FLOPs: decode step time, prefill time, KV capacity.

Decode is memory-bound: every step reads the weights the batch touches and the batch's KV cache,
so one step of a replica with B calls in flight takes

    t(B) = overhead + (dense bytes + routed-expert bytes touched by B tokens + B x context x KV
           bytes per token) / (replica GPUs x HBM bandwidth)

and each call in the batch gains one token per step. With E experts and k routed per token, B
tokens touch a share 1 - (1 - k/E)^B of the expert weights (independent routing: an assumption;
real routing is skewed, which touches fewer). Prefill is compute-bound: 2 x active parameters
FLOPs per token plus causal attention, at a stated MFU. The KV cache lives in the HBM left after
the weights (SGLang's ``--mem-fraction-static`` share of HBM, minus the weights).

Hybrid models (Gated DeltaNet layers beside full attention, e.g. Qwen3.5) keep KV only for the
full-attention layers and a fixed recurrent state (plus conv window) per request for the linear
ones. SGLang splits the HBM left after the weights into a state pool and a KV pool at
``--mamba-full-memory-ratio`` (state : KV, default 0.9), so the KV capacity is the KV share and the
requests a replica holds at once are bounded by the state pool (`state_slots`); every decode step
reads and writes each running request's state (2 x state bytes per call, on top of its KV).

A real engine reaches less than this roofline (kernel launches per layer, attention and sampling
per request, HBM bandwidth not saturated by small GEMVs). Three engine terms say by how much:
the step overhead, ``bw_efficiency`` (the share of HBM bandwidth the weight and KV reads reach)
and ``per_call_ms`` (time each call in the batch adds to a step), so

    t(B) = overhead + bytes read / (bandwidth x bw_efficiency) + B x per_call_ms

and ``engine_efficiency(B, context)`` = bytes / bandwidth / t(B) is the fraction of the roofline
reached. The presets take these from a fit on published measurements of other models and GPUs
(``gyre.sim.calibration.ENGINE_MEASUREMENTS``); the defaults (1.0, 0) are the bare roofline.

A replica that spans nodes (expert parallel over RDMA) also pays, in every MoE layer of every
step, a dispatch and a combine all-to-all: a latency floor each plus the bytes its tokens send to
experts on other nodes over the GPUs' RDMA bandwidth (``ep_all_to_all_s``).

This is the decode model of the simulator (``gyre.sim.cost_model.ClusterModel``) and of the paced
embedded engine (``engine.pace``), so a benchmark's live run and its simulation share one formula.
Every number of a spec is stated with its source in ``gyre/sim/calibration.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from gyre.config import ConfigError


@dataclass(frozen=True)
class ReplicaSpec:
    """One serving replica (an SGLang tensor/expert-parallel group) of one model on one GPU type."""
    gpus: int                      # GPUs per replica (TP x EP group)
    hbm_gb: float                  # per GPU
    hbm_tb_s: float                # per GPU, HBM bandwidth
    peak_tflops: float             # per GPU, dense BF16/FP8 compute used for prefill
    dense_gb: float                # weights every token reads (attention, norms, embeddings, shared experts)
    expert_gb: float               # routed-expert weights of the whole model (0 for a dense model)
    experts: int = 0               # routed experts per layer
    topk: int = 0                  # experts routed per token
    kv_bytes_per_token: float = 0.0
    overhead_ms: float = 2.5       # per decode step: kernel launches, TP all-reduce, scheduling
    active_params: float = 1.0e9   # parameters active per token (prefill FLOPs)
    attn_flops_per_ctx_token: float = 0.0  # extra prefill FLOPs per token per token of context
    prefill_mfu: float = 0.4
    mem_fraction: float = 0.88     # share of HBM SGLang may use for weights + KV
    state_bytes_per_request: float = 0.0  # hybrid: recurrent state + conv window of one request
    state_memory_ratio: float = 0.9  # SGLang --mamba-full-memory-ratio (state pool : KV pool)
    bw_efficiency: float = 1.0     # share of HBM bandwidth a real engine's decode reads reach
    per_call_ms: float = 0.0       # per decode step, per call in the batch (attention, sampling)
    # Cross-node expert parallelism (0 for a replica inside one node's NVLink domain):
    ep_remote_share: float = 0.0   # share of a token's routed experts on other nodes
    moe_layers: int = 0            # all-to-all pairs (dispatch + combine) per step
    a2a_bytes_per_token: float = 0.0  # per MoE layer: topk x hidden x (FP8 dispatch + BF16 combine)
    a2a_floor_us: float = 0.0      # per all-to-all, whatever the bytes
    rdma_gb_s: float = 50.0        # per GPU

    def __post_init__(self) -> None:
        for name in ("gpus", "hbm_gb", "hbm_tb_s", "peak_tflops", "active_params", "prefill_mfu", "mem_fraction"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"replica spec: {name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.ep_remote_share < 1:
            raise ConfigError(f"replica spec: ep_remote_share is a share in [0, 1), got {self.ep_remote_share}")
        if not 0 < self.bw_efficiency <= 1:
            raise ConfigError(f"replica spec: bw_efficiency is a share of HBM bandwidth in (0, 1], got {self.bw_efficiency}")
        for name in ("dense_gb", "expert_gb", "kv_bytes_per_token", "overhead_ms", "attn_flops_per_ctx_token",
                     "state_bytes_per_request", "state_memory_ratio", "per_call_ms", "moe_layers",
                     "a2a_bytes_per_token", "a2a_floor_us", "rdma_gb_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"replica spec: {name} must be >= 0, got {getattr(self, name)}")
        if self.expert_gb > 0 and not 0 < self.topk <= self.experts:
            raise ConfigError(f"replica spec: an MoE needs 0 < topk <= experts, got topk {self.topk} of {self.experts}")
        if self.weights_gb >= self.gpus * self.hbm_gb * self.mem_fraction:
            raise ConfigError(f"replica spec: {self.weights_gb:.0f} GB of weights do not fit {self.gpus} x "
                              f"{self.hbm_gb:g} GB x {self.mem_fraction:.0%}; use more GPUs per replica")

    @property
    def weights_gb(self) -> float:
        return self.dense_gb + self.expert_gb

    @property
    def bandwidth(self) -> float:
        """Bytes per second of the whole replica."""
        return self.gpus * self.hbm_tb_s * 1e12

    def expert_share(self, batch: float) -> float:
        """Share of the routed-expert weights B tokens touch in one step."""
        if self.expert_gb <= 0 or batch <= 0:
            return 0.0
        return 1.0 - (1.0 - self.topk / self.experts) ** batch

    # Each cost below is written once, as a function with the spec's constants bound (the
    # simulator binds it once and calls it per event: hoisting the constants is most of its
    # speed); the `*_s` methods are the same function, bound at the call.
    def roofline_fn(self) -> Callable[[float, float], float]:
        """Bytes one decode step reads over the replica's HBM bandwidth: the physical floor."""
        dense, expert, kv, state2 = self.dense_gb, self.expert_gb, self.kv_bytes_per_token, 2 * self.state_bytes_per_request
        moe, bandwidth = expert > 0, self.bandwidth
        keep = 1.0 - self.topk / self.experts if moe else 0.0  # share of experts a token leaves untouched

        def roofline(batch: float, context: float) -> float:
            b = batch if batch > 1.0 else 1.0
            # routed experts: the share B tokens touch, 1 - (1 - k/E)^B
            read = (dense + expert * ((1.0 - keep ** b) if moe else 0.0)) * 1e9 + b * (context * kv + state2)
            return read / bandwidth

        return roofline

    def ep_fn(self) -> Callable[[float], float]:
        """Cross-node expert-parallel traffic of one decode step: per MoE layer a dispatch and a
        combine, each a latency floor plus the batch's remote bytes over every GPU's RDMA link."""
        if self.ep_remote_share <= 0 or self.moe_layers <= 0:
            return lambda batch: 0.0
        a2a, remote_share, layers = self.a2a_bytes_per_token, self.ep_remote_share, self.moe_layers
        floor2, link = 2 * self.a2a_floor_us / 1e6, self.gpus * self.rdma_gb_s * 1e9

        def ep(batch: float) -> float:
            b = batch if batch > 1.0 else 1.0
            return layers * (floor2 + b * a2a * remote_share / link)

        return ep

    def step_fn(self) -> Callable[[float, float], float]:
        """Seconds of one decode step with `batch` calls of mean context `context` tokens:
        overheads + roofline_fn / bw_efficiency + ep_fn. The simulator asks it at most events, so
        the roofline and the EP traffic are written out here (the same floats, in the same order,
        as calling those functions: a test holds them equal) instead of two more calls each time."""
        over, per_call, bw_eff = self.overhead_ms, self.per_call_ms, self.bw_efficiency
        dense, expert, kv, state2 = self.dense_gb, self.expert_gb, self.kv_bytes_per_token, 2 * self.state_bytes_per_request
        moe, bandwidth = expert > 0, self.bandwidth
        keep = 1.0 - self.topk / self.experts if moe else 0.0
        if self.ep_remote_share > 0 and self.moe_layers > 0:
            a2a, remote_share, layers = self.a2a_bytes_per_token, self.ep_remote_share, self.moe_layers
            floor2, link = 2 * self.a2a_floor_us / 1e6, self.gpus * self.rdma_gb_s * 1e9

            def step(batch: float, context: float) -> float:
                b = batch if batch > 1.0 else 1.0
                read = (dense + expert * ((1.0 - keep ** b) if moe else 0.0)) * 1e9 + b * (context * kv + state2)
                t = (over + b * per_call) / 1e3 + read / bandwidth / bw_eff
                return t + layers * (floor2 + b * a2a * remote_share / link)
        else:
            def step(batch: float, context: float) -> float:
                b = batch if batch > 1.0 else 1.0
                read = (dense + expert * ((1.0 - keep ** b) if moe else 0.0)) * 1e9 + b * (context * kv + state2)
                return (over + b * per_call) / 1e3 + read / bandwidth / bw_eff

        return step

    def roofline_s(self, batch: float, context: float) -> float:
        return self.roofline_fn()(batch, context)

    def ep_all_to_all_s(self, batch: float) -> float:
        return self.ep_fn()(batch)

    def step_s(self, batch: float, context: float) -> float:
        return self.step_fn()(batch, context)

    def engine_efficiency(self, batch: float, context: float) -> float:
        """Fraction of the roofline the engine reaches at this batch and context."""
        return self.roofline_s(batch, context) / self.step_s(batch, context)

    def marginal_call_s(self, context: float) -> float:
        """What one more call at `context` adds to a step however large the batch (its KV and
        state reads and its per-call time; the weights are shared): the saturated cost per token."""
        read = context * self.kv_bytes_per_token + 2 * self.state_bytes_per_request
        remote = self.moe_layers * self.a2a_bytes_per_token * self.ep_remote_share / (self.gpus * self.rdma_gb_s * 1e9)
        return self.per_call_ms / 1e3 + read / (self.bandwidth * self.bw_efficiency) + remote

    def prefill_fn(self) -> Callable[[float, float], float]:
        """Seconds to prefill `tokens` new tokens appended to `context` cached ones (FLOP-bound)."""
        active2, attn = 2 * self.active_params, self.attn_flops_per_ctx_token
        rate = self.gpus * self.peak_tflops * 1e12 * self.prefill_mfu

        def prefill(tokens: float, context: float = 0.0) -> float:
            if tokens <= 0:
                return 0.0
            return tokens * (active2 + attn * (context + tokens / 2)) / rate

        return prefill

    def prefill_s(self, tokens: float, context: float = 0.0) -> float:
        return self.prefill_fn()(tokens, context)

    def prefill_floor_s(self, tokens: float) -> float:
        """Prefill time without attention (a lower bound however the tokens are split into calls)."""
        return max(0.0, tokens) * 2 * self.active_params / (self.gpus * self.peak_tflops * 1e12 * self.prefill_mfu)

    @property
    def _free_gb(self) -> float:
        return self.gpus * self.hbm_gb * self.mem_fraction - self.weights_gb

    @property
    def _state_share(self) -> float:
        """Share of the free HBM that holds recurrent states (0 without linear layers)."""
        if self.state_bytes_per_request <= 0:
            return 0.0
        return self.state_memory_ratio / (1.0 + self.state_memory_ratio)

    @property
    def kv_capacity_tokens(self) -> float:
        """Tokens of KV (prefix cache included) the replica holds."""
        if self.kv_bytes_per_token <= 0:
            return float("inf")
        return self._free_gb * (1.0 - self._state_share) * 1e9 / self.kv_bytes_per_token

    @property
    def state_slots(self) -> float:
        """Requests whose recurrent state the replica holds at once (inf: no linear layers)."""
        if self.state_bytes_per_request <= 0:
            return float("inf")
        return self._free_gb * self._state_share * 1e9 / self.state_bytes_per_request
