"""One typed configuration for a Gyre run: a TOML file plus ``section.key=value`` overrides.

Every section is a dataclass; a field's ``metadata`` may carry ``choices``, ``min`` and ``max``.
Validation names the key, the bad value and what is allowed, so a user on a shared cluster can
fix a config without reading code. This module is the only place that reads the environment.

Values that pick behaviour (the scheme, the staleness rule, the engine and trainer backends) are
enums (``StrEnum``: each member is its own string, so files, reports and tests read the same):
checked once here, compared as members everywhere else.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import tomllib
import typing
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from gyre.config_choices import (  # noqa: F401  (re-exported: gyre.config is where users import them)
    ConfigError, Scheme, StalenessRule, EngineBackend, TrainBackend, _EnumFields,
    WandbMode, BestMode, InitOptimizer, TemplateSource, History, ToolParser,
    ReasoningParser, Compression, Layout, Advantage, OffPolicyMode, Dtype,
    BurstOrder, Sandbox, ImageRuntime, SandboxNetwork, ResumeMode, EvalNetwork,
    EvalExecutor, EvalOutput, LrSchedule, KlEstimator, SamplingPolicy, enum_value,
    DatasetFormat)


def _f(default: Any, *, choices: tuple | None = None, min: float | None = None,
       max: float | None = None, help: str = "") -> Any:
    if isinstance(default, Enum):  # the enum is the list of choices (help and docs show them)
        choices = tuple(m.value for m in type(default))
    meta = {"choices": choices, "min": min, "max": max, "help": help}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class RunConfig(_EnumFields):
    _SECTION = "run"
    name: str = _f("gyre", help="run name, used in directory and job names")
    dir: str = _f("runs/gyre", help="run directory (private to the user, 0700)")
    seed: int = _f(0, min=0,
        help="seed of the trainer's initialisation and of the shuffled burst order (sched.burst_order)")
    steps: int = _f(4, min=1, help="optimizer steps of an online run (`gyre run`)")
    groups_per_step: int = _f(2, min=1, help="queries (groups of harness.group_size executions) per step")
    heartbeat_timeout_s: float = _f(60.0, min=1.0, help="a cell silent this long is marked failed")
    loggers: list = _f(["jsonl", "tensorboard", "wandb"],
                       help="metrics backends: metrics.jsonl is always written; tensorboard and wandb are "
                            "used when installed (see gyre/report/metrics.py)")
    wandb_mode: WandbMode = _f(WandbMode.OFFLINE,
                         help="W&B mode; offline runs sync later with `wandb sync`")
    keep_checkpoints: int = _f(0, min=0, help="trainer checkpoints kept in the run directory, newest first "
                                             "(the one state.json resumes from is always among them); 0 = all")
    checkpoint_every: int = _f(1, min=1, help="keep the trainer checkpoint of every N-th step (run.keep_checkpoints "
                                              "counts those); the others go once the next step is committed "
                                              "(gyre/services/retention.py)")
    keep_best: int = _f(0, min=0, help="also keep the checkpoints of the N best steps by run.best_metric")
    best_metric: str = _f("", help="a key of the step rows (steps.jsonl), e.g. a validation reward, that "
                                   "run.keep_best ranks checkpoints by; steps without it are not ranked")
    best_metric_mode: BestMode = _f(BestMode.MAX, help="whether a higher (max) or lower (min) run.best_metric is better")
    disk_budget_gb: float = _f(0.0, min=0.0, help="bound on the run's engine exports and checkpoints together (GB); a "
                                                  "warning before the next step would cross it; 0 = none")
    warn_entropy_below: float = _f(0.05, min=0.0, help="health warning when a step's mean token entropy "
                                   "(nats) falls below this: the policy is collapsing (gyre/report/health.py)")
    warn_harness_failure_rate: float = _f(0.5, min=0.0, max=1.0,
                                          help="health warning when more than this share of a step's "
                                               "executions ended failed or crashed (their harness broke: "
                                               "never trained, recorded in ledger.jsonl with exit status "
                                               "and stderr)")
    stop_harness_failure_steps: int = _f(2, min=0, help="stop the run (exit 1, with the harnesses' error) after "
                                         "this many steps in a row above run.warn_harness_failure_rate; 0 = never")

    def __setattr__(self, name: str, value: Any) -> None:
        # Validate here, not in __post_init__: load_config sets fields after construction.
        if name == "loggers":
            known = ("jsonl", "tensorboard", "wandb")
            if isinstance(value, str) or not all(isinstance(x, str) and x.strip() in known for x in value):
                raise ConfigError(f"run.loggers: {value!r} must be a list drawn from {', '.join(known)}, "
                                  f"e.g. ['jsonl', 'tensorboard']")
            value = [x.strip() for x in value]
        super().__setattr__(name, value)


@dataclass
class ModelConfig(_EnumFields):
    _SECTION = "model"
    path: str = _f("", help="model directory (transformers layout); empty = the embedded tiny model")
    tiny_dir: str = _f("", help="where the embedded tiny model is built; empty = ~/.cache/gyre/tiny-qwen "
                                "(tiny-<family> for another family)")
    tiny_family: str = _f("qwen2", choices=("qwen2", "llama", "qwen3", "qwen3_moe", "qwen2_moe", "qwen3_next",
                                            "qwen3_5", "qwen3_5_moe"),
                          help="family of the embedded tiny model (`gyre make-model --family`)")
    init_from: str = _f("", help="start from trained weights: a `gyre export` directory (it is the run's model, "
                                 "in place of model.path); empty = model.path")
    init_optimizer: InitOptimizer = _f(InitOptimizer.FRESH,
                                       help="with model.init_from: a fresh optimizer, or the Adam state carried from "
                                            "the checkpoint of the step it was exported from (still on disk)")


@dataclass
class EngineConfig(_EnumFields):
    _SECTION = "engine"
    backend: EngineBackend = _f(EngineBackend.EMBEDDED, help="the inference engine of every cell: embedded (Gyre's own, "
                                "CPU), sglang (GPU nodes) or vllm (vLLM's server; CPU build via `make install-vllm`); "
                                "docs/models.md says which runs what, and where")
    host: str = _f("127.0.0.1", help='address the engines of `gyre engine`/`gyre rollout` listen on')
    port: int = _f(30000, min=0, max=65535,
        help='first port of the engines of `gyre engine`/`gyre rollout`; 0 = any free port')
    endpoints: int = _f(1, min=1, help="engine endpoints started by `gyre rollout` on one machine")
    max_running_requests: int = _f(64, min=1, help='requests one engine decodes at once; more wait in its queue')
    max_new_tokens_cap: int = _f(4096, min=1, help="hard cap on max_new_tokens per request")
    max_body_bytes: int = _f(8 << 20, min=1024, help='largest request body an engine accepts (bytes)')
    request_timeout_s: float = _f(600.0, min=0.001,
        help='time the router waits for one engine request before it fails')
    connect_retries: int = _f(1, min=0, help="times the router retries an engine it cannot reach (connection "
                                             "refused or reset) before the call goes to another endpoint")
    sglang_launcher: str = _f("sglang.launch_server",
                              help="module run as `python -m MODULE` for engine.backend = sglang; tests use "
                                   "gyre.engine.sglang_standin (same flags, serves with the embedded engine)")
    sglang_args: list = _f([], help="extra sglang.launch_server flags, e.g. ['--mem-fraction-static', '0.8']")
    tp_size: int = _f(0, min=0, help="SGLang --tp-size over a cell; 0 = sched.gpus_per_node x the cell's nodes")
    vllm_python: str = _f("", help="python of the vLLM environment for engine.backend = vllm; empty = .venv-vllm/bin/"
                                   "python beside this checkout (built by `make install-vllm`)")
    vllm_args: list = _f([], help="extra vLLM server flags, e.g. ['--max-num-batched-tokens', '4096'] (a flag Gyre "
                                  "passes itself, given here, wins)")
    vllm_kv_cache_gb: int = _f(1, min=1, help="vLLM's CPU KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE)")
    startup_timeout_s: float = _f(1800.0, min=1.0, help="bound on an engine's start until /health answers "
                                                          "(large models load for minutes)")
    pace: bool = _f(False, help="benchmarks only: each decode step of the embedded engine lasts the roofline "
                                "step time of its batch under the paced replica spec (gyre/engine/pace.py), so "
                                "it behaves like a loaded GPU replica; figures from paced runs say so")


@dataclass
class ProxyConfig(_EnumFields):
    _SECTION = "proxy"
    host: str = _f("127.0.0.1", help='address the proxy listens on (harnesses are given its URL)')
    port: int = _f(0, min=0, max=65535, help="0 = any free port (harnesses are given the URL)")
    max_body_bytes: int = _f(8 << 20, min=1024, help="largest request body accepted (bytes)")
    default_max_tokens: int = _f(512, min=1, help='max_tokens of a call that names none')
    max_tokens_cap: int = _f(4096, min=1, help='largest max_tokens a call may ask for; more is cut to this')
    max_calls_in_flight: int = _f(8, min=1, help="calls of one execution running at once; beyond, 429 with "
                                  "Retry-After (a few parallel tool calls; gyre/proxy/fairness.py)")
    max_executions: int = _f(10_000, min=1, help="executions registered at once (POST /gyre/executions "
                                                 "beyond it is a 429)")
    chat_template: TemplateSource = _f(TemplateSource.BUILTIN,
                            help="builtin: Gyre's ChatML (Qwen2.5 format); model: the model directory's own Jinja "
                                 "template (chat_template.jinja or tokenizer_config.json), checked by token ids at start "
                                 "(refused, with the reason, when Gyre cannot follow it exactly)")
    history: History = _f(History.EXACT,
                      help="with a template that is not append-only: exact keeps sampled turns as sampled; "
                           "template follows the template and branches the tree where it rewrites history")
    tool_parser: ToolParser = _f(ToolParser.HERMES,
                          help="tool-call format of the model's output (chat_template = model)")
    reasoning_parser: ReasoningParser = _f(ReasoningParser.NONE,
                               help="qwen3: <think>...</think> goes to reasoning_content (chat_template = model)")
    sampling: SamplingPolicy = _f(SamplingPolicy.HARNESS,
                                  help="rollout sampling of training executions (docs/openai.md, 'Sampling policy and token budget'): "
                                       "harness = the harness's temperature/top_p; fix = proxy.temperature and "
                                       "proxy.top_p whatever the harness sends; clamp = the harness's values moved "
                                       "into [temperature_min, temperature_max] and [top_p_min, 1]; refuse = a call "
                                       "outside those bounds gets a 400 naming the bound")
    temperature: float = _f(1.0, min=0.0, max=2.0, help="sampling = fix: the temperature every call samples at")
    top_p: float = _f(1.0, min=1e-6, max=1.0, help="sampling = fix: the top_p every call samples with")
    temperature_min: float = _f(0.0, min=0.0, max=2.0, help="sampling = clamp/refuse: lowest temperature "
                                "(greedy decoding, temperature 0 or top_p 0, counts as temperature 0)")
    temperature_max: float = _f(2.0, min=0.0, max=2.0, help="sampling = clamp/refuse: highest temperature")
    top_p_min: float = _f(0.0, min=0.0, max=1.0, help="sampling = clamp/refuse: lowest top_p")
    execution_token_budget: int = _f(0, min=0, help="sampled (completion) tokens one execution may use; the call "
                                     "that reaches it is cut to what is left, later calls are refused "
                                     "(token_budget_exhausted) and the execution ends as timed out, scored as "
                                     "a timeout is (tests-after-timeout); 0 = no budget")


@dataclass
class StoreConfig(_EnumFields):
    _SECTION = "store"
    dir: str = _f("", help="shard directory; empty = <run.dir>/shards")
    # benchmarks/results/store.json: "none" writes at ~0.6x numpy.save + fsync (0.1-0.35x of a
    # page-cache-only numpy.save) with the shard ~0.97x the raw size (tables always deflated);
    # gzip level 1 halves the size but writes ~10x slower on a 2-core head; lzf needs a plugin
    # outside h5py (HDFView cannot read it)
    compression: Compression = _f(Compression.NONE,
                          help="filter for the tokens/logprobs arrays (tables are always gzip)")
    compression_level: int = _f(1, min=0, max=9, help="gzip level when compression = gzip")
    chunk_tokens: int = _f(1 << 16, min=256, help="HDF5 chunk of the tokens/logprobs arrays (elements)")
    hdf5_locking: bool = _f(False, help="HDF5 file locking; off by default: Lustre/GPFS mounts "
                                        "without flock make HDF5 fail to open files")
    executions_per_shard: int = _f(64, min=1, help='executions written to one HDF5 shard before a new one starts')


@dataclass
class SelectionConfig:
    k: str = _f("5", help="trajectories per execution: a positive integer K (the K best leaves by "
                          "role priority), 'all' (every leaf) or 'main' (every leaf of role 'main')")
    role_priority: list = _f(["main", "subagent:*", "compactor"],
                             help="agent-role glob patterns, best first; unmatched roles rank last")

    MODES = ("all", "main")
    _ALIASES = {"main-only": "main", "main_only": "main"}

    @classmethod
    def parse_k(cls, value: Any) -> int | str:
        """``selection.k`` as an int K >= 1, 'all' or 'main', or ConfigError naming the key."""
        text = str(value).strip().lower() if not isinstance(value, bool) else ""
        text = cls._ALIASES.get(text, text)
        if text in cls.MODES:
            return text
        if text.isdigit() and int(text) >= 1:
            return int(text)
        raise ConfigError(f"selection.k: {value!r} is not allowed; use a positive integer, "
                          f"'all' or 'main'")

    def __setattr__(self, name: str, value: Any) -> None:
        # Validate here, not in __post_init__: load_config sets fields after construction.
        if name == "k":
            value = str(self.parse_k(value))
        elif name == "role_priority":
            if isinstance(value, str) or not all(isinstance(p, str) and p.strip() for p in value):
                raise ConfigError(f"selection.role_priority: {value!r} must be a list of non-empty "
                                  f"role patterns, e.g. ['main', 'subagent:*', 'compactor']")
            value = [p.strip() for p in value]
        super().__setattr__(name, value)


@dataclass
class TrainConfig(_EnumFields):
    _SECTION = "train"
    backend: TrainBackend = _f(TrainBackend.EMBEDDED,
        help='trainer: embedded (torch, CPU or one GPU) or megatron (Megatron-Core)')
    lr: float = _f(1e-4, min=0.0, help="Adam's peak learning rate (after warmup; the constant rate with lr_schedule = constant)")
    lr_schedule: LrSchedule = _f(LrSchedule.CONSTANT,
                                 help="learning rate over optimizer steps, Megatron's formulas (gyre/train/lr_schedule.py): "
                                      "constant = lr; linear / cosine = decay from lr to min_lr over lr_decay_steps; "
                                      "all after lr_warmup_steps of linear warmup from 0")
    lr_warmup_steps: int = _f(0, min=0, help="optimizer steps of linear warmup to lr (the first step trains at "
                                             "lr / lr_warmup_steps); 0 = none")
    lr_decay_steps: int = _f(0, min=0, help="optimizer step at which linear/cosine decay reaches min_lr; 0 = "
                                            "run.steps (the run's last step trains at min_lr)")
    min_lr: float = _f(0.0, min=0.0, help="learning rate at the end of linear/cosine decay (at most lr)")
    kl_coef: float = _f(0.0, min=0.0, help="weight of the KL penalty to a frozen reference (the initial weights, "
                                           "held by every trainer rank: one more copy of the parameters, one more "
                                           "no-grad forward per micro-batch); 0 = off, no reference is built")
    kl_estimator: KlEstimator = _f(KlEstimator.K3, help="KL(pi_theta || pi_ref) estimator per target token "
                                  "(Schulman): k1 = log r, k2 = (log r)^2 / 2, k3 = 1/r - 1 + log r, "
                                  "r = pi_theta / pi_ref")
    entropy_coef: float = _f(0.0, min=0.0, help="weight of the entropy bonus (the loss subtracts coef x the "
                                                "targets' token entropy, computed chunked); 0 = off")
    micro_batch_tokens: int = _f(4096, min=16,
        help='tokens of one micro-batch (a long execution is still one row: linear memory, never split)')
    layout: Layout = _f(Layout.TREE,
        help='tree: shared prefixes counted once (kv_end masks); expanded: one row per trajectory')
    advantage: Advantage = _f(Advantage.GRPO,
        help="grpo: reward minus the group mean, over the group std; rloo: minus the mean of the "
             "others; reward: the raw reward (no group baseline)")
    clip_low: float = _f(0.2, min=0.0, help='PPO ratio clip below: ratios under 1 - clip_low are clipped')
    clip_high: float = _f(0.28, min=0.0,
        help='PPO ratio clip above (clip-higher): ratios over 1 + clip_high are clipped')
    clip: bool = _f(True, help="PPO-style ratio clipping with clip_low/clip_high; false = plain IS ratio")
    staleness_weights: list = _f([], help="loss weight per policy lag [w0, w1, ...]; lags past the "
                                      "list are masked; empty = weight 1 for every admitted lag")
    off_policy: OffPolicyMode = _f(OffPolicyMode.AUTO,
                         help="correction for stale and mismatched samples (benchmarks/README.md, 'The loss'): "
                              "none = PPO "
                              "clip against the behaviour log-probs; tis = clip against pi_old (the trainer "
                              "at the step start, one extra no-grad forward) times min(pi_old/pi_behaviour, "
                              "is_cap); decoupled = AReaL's decoupled PPO, clip against pi_prox (the same "
                              "forward) times pi_prox/pi_behaviour; auto = decoupled when groups can lag "
                              "(sched.staleness > 0 or sched.steps_per_sync > 1) and train.minibatches_per_step "
                              "> 1, else tis (with one update per step the clip against pi_prox never acts: "
                              "clip_frac 0, benchmarks/bench_token_truth.py)")
    pace_tokens_per_s: float = _f(0.0, min=0.0, help="benchmarks only: a cell trains at most this many tokens per "
                                  "second (each micro-batch lasts its tokens at this rate, gyre/train/pace.py), "
                                  "so training has the share of cell time a stated rate gives it; 0 = unpaced")
    minibatches_per_step: int = _f(1, min=1, help="PPO-style optimizer updates within a step (AReaL uses 4): the "
                                   "step's micro-batches in this many parts, one update each, pi_prox from the "
                                   "step's start (tis, decoupled); live runs reduce once per update and export "
                                   "weights once per step")
    is_cap: float = _f(2.0, min=1.0, help="tis: C in min(pi_old / pi_behaviour, C)")
    is_mask: bool = _f(False, help="tis/decoupled: drop (weight 0) tokens whose pi_old / pi_behaviour "
                                   "leaves [is_mask_low, is_mask_high]")
    is_mask_low: float = _f(0.5, min=0.0, help='is_mask: lowest pi_old / pi_behaviour kept')
    is_mask_high: float = _f(2.0, min=0.0, help='is_mask: highest pi_old / pi_behaviour kept')
    mismatch_warn_k3: float = _f(0.01, min=0.0, help="warn when the k3 KL between trainer and engine "
                                 "log-probs at lag 0 (same weights) exceeds this; 0 = never")
    grad_clip: float = _f(1.0, min=0.0, help="clip the global grad norm to this; 0 = no clipping")
    weight_decay: float = _f(0.0, min=0.0, help='AdamW decoupled weight decay')
    adam_beta1: float = _f(0.9, min=0.0, max=1.0, help='Adam beta1 (first-moment decay)')
    adam_beta2: float = _f(0.999, min=0.0, max=1.0, help='Adam beta2 (second-moment decay)')
    adam_eps: float = _f(1e-8, min=0.0, help='Adam epsilon')
    dtype: Dtype = _f(Dtype.AUTO,
                    help="training dtype; auto = bfloat16 on CUDA, float32 on CPU")
    export_dir: str = _f("", help="where weights are exported for the engines; empty = <run.dir>/weights")
    checkpoint_dir: str = _f("", help="trainer checkpoints; empty = <run.dir>/checkpoints")
    tensor_parallel: int = _f(1, min=1,
        help="Megatron tensor-parallel size inside a cell (divides its trainer ranks)")
    pipeline_parallel: int = _f(1, min=1, help="Megatron pipeline-parallel size inside a cell; training "
                                 "refuses > 1 (no pipeline schedule), checkpoints convert between stages")
    expert_parallel: int = _f(1, min=1, help="Megatron expert-parallel size inside a cell (MoE models: divides the "
                                            "expert count and, times tensor x pipeline, the cell's trainer ranks)")
    moe_aux_loss_coef: float = _f(0.0, min=0.0, help="MoE load-balancing (aux) loss weight, added per micro-batch; "
                                                     "0 = off (its value is still logged by the embedded trainer)")
    routing_replay: bool = _f(False, help="MoE routing replay (R3): the proxy asks the engine for the experts it "
                                          "routed every token to (SGLang's return_routed_experts; SGLang cells "
                                          "start with --enable-return-routed-experts), the tree and shards keep "
                                          "them, and the trainer's forwards (pi_prox and training) use them")
    local_ranks: int = _f(1, min=1, help="trainer ranks per cell under `gyre run` (one machine); under Slurm a "
                                        "cell has one rank per GPU slot of its nodes (one per node on CPU)")
    recompute: bool = _f(False, help="activation checkpointing per decoder layer: a layer keeps only its input "
                                     "and runs again in backward (long rows: ~1/layers of the activations)")
    logprob_chunk: int = _f(4096, min=1, help="target positions projected onto the vocabulary at once: peak "
                                           "logits memory is logprob_chunk x vocab, never S x vocab")
    context_parallel: int = _f(1, min=1, help="Megatron-Core context-parallel size inside a cell: an expanded row "
                                             "longer than one GPU holds is packed (THD) and cut over this many "
                                             "ranks (Transformer Engine's attention); needs train.backend = "
                                             "\"megatron\" and train.layout = \"expanded\"")


@dataclass
class SchedConfig(_EnumFields):
    _SECTION = "sched"
    scheme: Scheme = _f(Scheme.E,
        help="E elastic (demand-sized), E-paper the paper's elastic rule, A async pools, C colocate")
    cells: int = _f(2, min=1, help='cells of the job (rollout + train); `gyre run` starts this many cell ranks')
    cell_nodes: int = _f(4, min=1, help='nodes of one cell (a Slurm het component each)')
    gpus_per_node: int = _f(8, min=0, help='GPUs of a node; 0 = CPU nodes')
    staleness: int = _f(0, min=0, help="max lag k in rollout syncs (= optimizer steps when steps_per_sync = 1)")
    staleness_rule: StalenessRule = _f(StalenessRule.WINDOW, help="window: a group lagging more than k syncs is dropped (and replaced); "
                                  "count: AReaL's rule, at rollout sync r at most (r+k+1) x groups-per-round started")
    steps_per_sync: int = _f(1, min=1, help="optimizer steps fed by one rollout round; weights pushed once per round")
    rollout_cells_async: int = _f(1, min=0, help="rollout pool size for scheme A")
    to_train_s: float = _f(8.52, min=0.0, help="expected rollout->train switch time (paper: 8.52 s)")
    to_rollout_s: float = _f(3.46, min=0.0, help="expected train->rollout switch time (paper: 3.46 s)")
    push_s: float = _f(60.0, min=0.0, help="expected optimizer step + weight push per step")
    execs_per_cell: float = _f(16.0, min=0.001,
        help="schemes E and E-paper: running executions one rollout cell serves")
    min_dwell_s: float = _f(60.0, min=0.0, help="schemes E, E-paper: least time a cell stays in a role")
    calls_per_cell: float = _f(4.0, min=0.001, help="scheme E: calls one rollout cell decodes while each keeps "
                               "~80% of its solo speed (engines per cell x their batch knee)")
    train_tokens_per_s: float = _f(43800.0, min=0.001, help="schemes E, E-paper: training tokens/s of one 4-node "
                                   "cell (nl2repo-122b-32n: FLOP arithmetic at 25% MFU, gyre/sim/calibration.py)")
    eval_s: float = _f(60.0, min=0.0, help="schemes E, E-paper: expected evaluation time of a finished execution")
    burst_order: BurstOrder = _f(BurstOrder.STREAM,
                          help="with steps_per_sync > 1: stream = a round's groups train in the order "
                               "they finish (early steps hold short executions); shuffle = wait for the "
                               "round, then deal its groups to its steps in a seeded random order")
    skip_zero_variance: bool = _f(True, help="a group whose executions all scored the same reward "
                                  "(no signal for grpo/rloo) is recorded as not admitted, reason zero_variance, "
                                  "and replaced by a new group (dynamic sampling)")
    max_replacements_per_step: int = _f(4, min=0, help="zero-variance groups replaced per step at most; "
                                        "past it they train as they are (the step trains what it has)")


@dataclass
class HarnessConfig(_EnumFields):
    _SECTION = "harness"
    suite: str = _f("builtin",
        help="task suite: 'builtin', 'learnable' (the demo's) or a directory in NL2RepoBench layout")
    command: list = _f(["{python}", "-m", "gyre.harness.reference_agent"],
                       help="harness argv; placeholders {prompt} {prompt_file} {workspace} {task_dir} "
                            "{python} {execution_id} {base_url}")
    tasks: list = _f([], help="names of the suite's tasks to run; empty = all")
    group_size: int = _f(2, min=1, help="executions per task (G)")
    concurrency: int = _f(4, min=1, help="harnesses running at once (N)")
    timeout_s: float = _f(600.0, min=0.1,
        help="wall-clock limit of one execution; past it the harness is stopped and its workspace "
             "scored (tests-after-timeout)")
    kill_grace_s: float = _f(5.0, min=0.0, help='time between SIGTERM and SIGKILL when a harness is stopped')
    cpu_limit_s: int = _f(0, min=0, help="RLIMIT_CPU per execution; 0 = none")
    memory_limit_mb: int = _f(0, min=0, help="RLIMIT_AS of each process of an execution; 0 = none")
    # Defaults that keep one harness from hurting the others on a shared node (0 = none):
    max_processes: int = _f(1024, min=0, help="processes one harness may run at once (its whole tree); in a "
                                              "sandbox the kernel caps it, and its evaluation's test commands, "
                                              "at 2 x this + 160 tasks")
    max_memory_mb: int = _f(16384, min=0, help="resident memory of one harness's whole process tree (MB)")
    max_log_mb: int = _f(64, min=0, help="bytes of stdout and of stderr kept per harness (MB); the rest is dropped")
    max_workspace_mb: int = _f(20480, min=0, help="bytes a harness's workspace may hold on disk (MB); also "
                                                  "the largest file it may write")
    max_workspace_files: int = _f(500000, min=0, help="entries (files, folders, links; empty ones too) a harness's "
                                                     "workspace may hold: a harness cannot exhaust the run "
                                                     "directory's inodes")
    tmpfs_mb: int = _f(2048, min=0, help="size of a sandboxed harness's (and evaluation's) /tmp, its HOME, and "
                                         "apart of its /dev/shm (MB; bubblewrap, enroot, podman, docker: Apptainer "
                                         "cannot size them and warns): what they hold is node memory "
                                         "on top of harness.max_memory_mb (up to 2 x tmpfs_mb more); 0 = unsized")
    max_start_failures: int = _f(3, min=0, help="harnesses in a row that cannot start in their sandbox before "
                                               "the run stops with the sandbox's error; 0 = never stop")
    limits_poll_s: float = _f(1.0, min=0.05, help="how often the process, memory and workspace limits are checked")
    pass_env: list = _f(["PATH", "HOME", "LANG", "LC_ALL", "TZ", "USER", "LOGNAME", "TMPDIR", "TERM", "SHELL"],
                        help="variables of Gyre's environment a harness sees; nothing else leaks to it")
    env: list = _f([], help="extra KEY=VALUE variables for the harness, e.g. MSWEA_CONFIGURED=true")
    min_scorable_share: float = _f(0.5, min=0.0, max=1.0, help="warn before running when fewer of the suite's "
                                   "tasks can be scored here (none scorable is always refused)")
    strict_suite: bool = _f(False, help="refuse a suite with a broken task folder (default: skip it "
                                        "with a warning and count it); `--strict` on the command line")
    image_template: str = _f("ghcr.io/multimodal-art-projection/nl2repobench/{task}:1.0",
                             help="image of a task that does not ship its tests ({task} = task name)")
    sandbox: Sandbox = _f(Sandbox.AUTO,
                      help="sandbox of harnesses and task commands without an image: auto = bubblewrap "
                           "where installed; none = no isolation (warns)")
    runtime: ImageRuntime = _f(ImageRuntime.AUTO,
                      help="runtime of task images; auto = by the file found in image_dir "
                           "(<task>/ rootfs: bwrap, <task>.sif: apptainer, <task>.sqsh: enroot)")
    image_dir: str = _f("", help="where task images live: <task>.sif, <task>.sqsh or an unpacked <task>/")
    image_python: str = _f("python3", help="the Python inside task images (runs Gyre's launcher)")
    sandbox_network: SandboxNetwork = _f(SandboxNetwork.PROXY,
                              help="proxy: an instance reaches only the proxy (where the runtime can "
                                   "restrict it); host: the host's network")
    sandbox_binds: list = _f([], help="extra read-only host paths SRC[:DST] a sandboxed harness needs "
                                      "(e.g. its own virtualenv)")
    infra_retries: int = _f(2, min=0, help="an execution whose sandbox or process could not start is tried "
                                          "again this many times (alone, in a fresh workspace), then recorded lost")
    resume: ResumeMode = _f(ResumeMode.REPLAY,
                     help="an execution stopped mid-run (preemption, SIGTERM) on resume: replay = its harness "
                          "restarts in a fresh workspace and every request equal to a recorded call is answered "
                          "from the recording; restart = from scratch, recorded calls unused")


@dataclass
class EvalConfig(_EnumFields):
    _SECTION = "eval"
    timeout_s: float = _f(300.0, min=0.0, help="time limit for all test commands of one evaluation of a task "
                                               "that ships its tests; 0 = none")
    image_timeout_s: float = _f(0.0, min=0.0, help="the same for a task scored in its image (NL2RepoBench: the "
                                                   "official runner has none, one task has 2,182 tests); 0 = none")
    command_timeout_s: float = _f(0.0, min=0.0, help="time limit of each test command; 0 = none")
    network: EvalNetwork = _f(EvalNetwork.AUTO,
                      help="network of the test commands: auto = on for tasks scored in their image (NL2RepoBench's "
                           "commands `pip install`, as its containers allow), off otherwise")
    workers: int = _f(2, min=1, help="evaluations running at once")
    executor: EvalExecutor = _f(EvalExecutor.POOL,
        help='where evaluations run: pool (processes on the head), submitit-local or submitit-slurm (a Slurm job each)')
    scratch_dir: str = _f("", help="where workspaces are copied for scoring; empty = the system temp dir")
    keep_scratch: bool = _f(False, help="keep the scored copy (for debugging a score)")
    max_output_mb: int = _f(64, min=1, help="largest file (log included) a test command may write")
    output: EvalOutput = _f(EvalOutput.OFFICIAL,
                     help="what is scored of a test command: official = stdout when it succeeds, stdout and "
                          "stderr in python-on-whales' error text when it fails (NL2RepoBench); merged = both always")
    max_copy_mb: int = _f(20480, min=0, help="data of a workspace copied for scoring (MB; sparse holes are "
                                             "not copied); past it the evaluation fails naming this key")
    remove_conftest: bool = _f(False, help="also delete the candidate's conftest.py files (NL2RepoBench keeps them)")
    submitit_dir: str = _f("", help="submitit job folder; empty = <run.dir>/eval-jobs")
    slurm_partition: str = _f("", help="partition for submitit-slurm evaluation jobs")
    slurm_cpus_per_task: int = _f(2, min=1, help='CPUs of one submitit-slurm evaluation job')
    slurm_mem_gb: int = _f(8, min=1, help='memory of one submitit-slurm evaluation job (GB)')




@dataclass
class DatasetConfig(_EnumFields):
    """Tasks as rows of a dataset (gyre/harness/datasets.py has the schema); replaces harness.suite."""
    _SECTION = "dataset"
    path: str = _f("", help="a JSONL or parquet file, or a local Hugging Face `datasets` directory (save_to_disk), "
                            "of task rows (schema: docs/recipes/datasets.md); empty = the tasks of harness.suite")
    format: DatasetFormat = _f(DatasetFormat.AUTO, help="how `path` is read; auto = by its suffix (.jsonl, "
                                                        ".parquet) or a directory as a Hugging Face dataset")
    hf_split: str = _f("train", help="the split read from a Hugging Face DatasetDict directory")
    shuffle: bool = _f(True, help="shuffle the training tasks with `seed` (else file order)")
    seed: int = _f(0, help="seed of the shuffle, the weighted draw and the validation split")
    validation_share: float = _f(0.0, min=0.0, max=0.9,
                                 help="share of rows (those without a `split` field) held out for validation, "
                                      "chosen with `seed`; rows with split = \"validation\" are held out always")


@dataclass
class RewardConfig:
    """Your reward (gyre/harness/reward.py): replaces the tests' score when set."""
    _SECTION = "reward"
    function: str = _f("", help="`module:function` called as f(workspace, task, tests, calls) -> float or "
                                "{name: float} (parts summed, or the part named `reward`); run in a "
                                "subprocess in the harness's sandbox (workspace read-only at /workspace; "
                                "docs/recipes/reward.md); empty = the tests' score (the workspace evaluator)")
    url: str = _f("", help="a reward server: the same arguments POSTed as JSON, the answer's float or "
                           "object read the same way; used when `function` is empty")
    pythonpath: list = _f([], help="directories put before the reward function's import path")
    timeout_s: float = _f(60.0, min=0.1, help="time limit of one reward call; past it the execution is "
                                              "not scored (reward-error), never 0")
    memory_mb: int = _f(2048, min=0, help="address-space limit of the reward subprocess (0 = none)")


@dataclass
class ValidateConfig:
    """Validation rounds on held-out tasks (gyre/services/validation.py): never trained."""
    _SECTION = "validate"
    every_steps: int = _f(0, min=0, help="a validation round every N optimizer steps (0 = no validation "
                                         "during `gyre run`); also before the first and after the last step")
    at_start: bool = _f(True, help="a round before the first step (at version 0 or the resumed version)")
    at_end: bool = _f(True, help="a round after the last step")
    suite: str = _f("", help="the held-out suite ('builtin', 'learnable' or a folder); empty = the dataset's "
                             "validation split (dataset.validation_share)")
    tasks: list = _f([], help="names of the held-out tasks to run; empty = all")
    samples: int = _f(4, min=1, help="n: executions per task and round")
    k: int = _f(4, min=1, help="pass@k reported besides pass@1 (unbiased estimator, k <= samples)")
    pass_threshold: float = _f(1.0, help="an execution passes when its reward is at least this")
    temperature: float = _f(1.0, min=0.0, max=2.0, help="sampling temperature of validation calls (set at "
                                                        "the proxy, whatever the harness sends)")
    top_p: float = _f(1.0, min=0.0, max=1.0, help="top-p of validation calls (set at the proxy)")


@dataclass
class GyreConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sched: SchedConfig = field(default_factory=SchedConfig)
    harness: HarnessConfig = field(default_factory=HarnessConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    validate: ValidateConfig = field(default_factory=ValidateConfig)

    def shard_dir(self) -> Path:
        return Path(self.store.dir) if self.store.dir else Path(self.run.dir) / "shards"


def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Convert a TOML or command-line value to the field's type, or raise naming the key."""
    origin = typing.get_origin(typ) or typ
    if isinstance(origin, type) and issubclass(origin, Enum):
        if isinstance(value, (str, int)) and not isinstance(value, bool):  # as a str field would
            return enum_value(key, str(value), origin)
    elif origin is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
    elif origin is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value, 0)
            except ValueError:
                pass
    elif origin is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif origin is str:
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            return str(value)
    elif origin is list:
        if isinstance(value, list):
            return value
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
    else:  # pragma: no cover - only the types above are used
        return value
    raise ConfigError(f"{key}: expected {getattr(origin, '__name__', origin)}, got {value!r}")


def _check(key: str, value: Any, meta: dict) -> None:
    choices, lo, hi = meta.get("choices"), meta.get("min"), meta.get("max")
    if choices is not None and value not in choices:
        raise ConfigError(f"{key}: {value!r} is not allowed; choose one of {', '.join(map(str, choices))}")
    if lo is not None and value < lo:
        raise ConfigError(f"{key}: {value!r} is below the minimum {lo}")
    if hi is not None and value > hi:
        raise ConfigError(f"{key}: {value!r} is above the maximum {hi}")


def _apply(obj: Any, data: dict, prefix: str) -> None:
    fields = {f.name: f for f in dataclasses.fields(obj)}
    hints = typing.get_type_hints(type(obj))
    for name, value in data.items():
        key = f"{prefix}{name}"
        if name not in fields:
            near = difflib.get_close_matches(name, fields, n=3, cutoff=0.6)
            hint = (f"did you mean {' or '.join(prefix + n for n in near)}?" if near
                    else f"known keys here: {', '.join(sorted(fields))}")
            raise ConfigError(f"{key}: unknown key; {hint}")
        current = getattr(obj, name)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: expected a table [{key}], got {value!r}")
            _apply(current, value, key + ".")
            continue
        coerced = _coerce(key, value, hints[name])
        _check(key, coerced, dict(fields[name].metadata))
        setattr(obj, name, coerced)


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected section.key=value, e.g. engine.port=30001")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"override {text!r}: expected section.key=value, e.g. engine.port=30001")
    try:  # accept TOML literals (numbers, booleans, arrays, quoted strings); else a bare string
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return parts, value


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> GyreConfig:
    """Load ``path`` (TOML; None = defaults), then apply ``section.key=value`` overrides."""
    cfg = GyreConfig()
    if path is not None:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file {p} does not exist") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
        _apply(cfg, data, "")
    for text in overrides or []:
        parts, value = _parse_override(text)
        nested: dict = {}
        cur = nested
        for part in parts[:-1]:
            cur = cur.setdefault(part, {})
        cur[parts[-1]] = value
        _apply(cfg, nested, "")
    _cross_check(cfg)
    return cfg


def _cross_check(cfg: GyreConfig) -> None:
    """Rules that span keys (each key alone was checked by `_apply`)."""
    _check_loop(cfg)
    if cfg.model.init_optimizer == InitOptimizer.CARRIED and not cfg.model.init_from:
        raise ConfigError("model.init_optimizer = \"carried\" needs model.init_from (a `gyre export` directory "
                          "whose step's checkpoint holds the optimizer state)")
    t = cfg.train
    if t.is_mask and not t.is_mask_low < t.is_mask_high:
        raise ConfigError(f"train.is_mask_low ({t.is_mask_low}) must be below train.is_mask_high "
                          f"({t.is_mask_high})")
    if t.context_parallel > 1 and t.layout == Layout.TREE:
        raise ConfigError(f"train.context_parallel = {t.context_parallel} cuts rows over ranks, and a tree "
                          "row's subtrees attend to keys across the cut: set train.layout = \"expanded\" "
                          "or keep train.context_parallel = 1")
    if t.routing_replay and cfg.engine.backend == EngineBackend.VLLM:
        raise ConfigError("train.routing_replay needs the routed experts of every call, which Gyre's vLLM backend does "
                          "not return (vLLM's routed-experts output is not wired here; SGLang's is): use "
                          "engine.backend = \"sglang\" or \"embedded\", or set train.routing_replay = false")
    if t.context_parallel > 1 and t.backend != TrainBackend.MEGATRON:
        raise ConfigError(f"train.context_parallel = {t.context_parallel} needs train.backend = \"megatron\" "
                          "(the embedded trainer keeps a row on one device); or keep train.context_parallel = 1")
    if t.min_lr > t.lr:
        raise ConfigError(f"train.min_lr ({t.min_lr:g}) must not exceed train.lr ({t.lr:g}): decay goes from lr "
                          "down to min_lr")
    if t.pipeline_parallel > 1:
        raise ConfigError(f"train.pipeline_parallel = {t.pipeline_parallel}: Gyre's Megatron trainer does not run "
                          "Megatron's pipeline schedule, so it cannot train at pipeline stages; set "
                          "train.pipeline_parallel = 1 (use tensor_parallel / expert_parallel to split a model)")
    if t.entropy_coef > 0 and t.tensor_parallel > 1:
        raise ConfigError(f"train.entropy_coef > 0 needs each target's whole-vocabulary distribution, which a "
                          f"tensor-parallel rank does not hold (train.tensor_parallel = {t.tensor_parallel}): "
                          "set train.tensor_parallel = 1 or train.entropy_coef = 0")
    decay = t.lr_decay_steps or cfg.run.steps
    if t.lr_schedule != LrSchedule.CONSTANT and t.lr_warmup_steps >= decay:
        raise ConfigError(f"train.lr_warmup_steps ({t.lr_warmup_steps}) must be below the decay horizon "
                          f"({decay}: train.lr_decay_steps, or run.steps when it is 0) for lr_schedule = "
                          f"{t.lr_schedule}")
    p = cfg.proxy
    if p.temperature_min > p.temperature_max:
        raise ConfigError(f"proxy.temperature_min ({p.temperature_min:g}) must not exceed proxy.temperature_max "
                          f"({p.temperature_max:g})")


def _check_loop(cfg: GyreConfig) -> None:
    """[validate] and [reward] rules that span keys."""
    v, r = cfg.validate, cfg.reward
    if v.k > v.samples:
        raise ConfigError(f"validate.k = {v.k} is more than validate.samples = {v.samples}: pass@k needs at "
                          "least k samples per task; raise validate.samples or lower validate.k")
    if r.function and (":" not in r.function or not all(r.function.split(":", 1))):
        raise ConfigError(f"reward.function: {r.function!r} is not `module:function` (e.g. "
                          "\"my_rewards:score\", with reward.pythonpath naming the module's folder)")
    if r.function and r.url:
        raise ConfigError("reward.function and reward.url are both set: choose one")
    if r.url and not r.url.startswith(("http://", "https://")):
        raise ConfigError(f"reward.url: {r.url!r} is not an http(s) URL")


def resolved_off_policy(cfg: GyreConfig) -> OffPolicyMode:
    """`train.off_policy` with `auto` decided: decoupled when groups can lag (sched.staleness > 0,
    or bursts of sched.steps_per_sync > 1 steps on one round's weights) and a step makes several
    updates (train.minibatches_per_step > 1), so that its clip against pi_prox can act; else tis.
    Measured: with one update per step clip_frac is 0 at every step (bench_token_truth.py), and
    the learning benchmark's staleness-2 runs favour tis (benchmarks/results/learning.json)."""
    if cfg.train.off_policy is not OffPolicyMode.AUTO:
        return cfg.train.off_policy
    lagged = cfg.sched.staleness > 0 or cfg.sched.steps_per_sync > 1
    return OffPolicyMode.DECOUPLED if lagged and cfg.train.minibatches_per_step > 1 else OffPolicyMode.TIS


def trainer_config(cfg: GyreConfig) -> TrainConfig:
    """The TrainConfig a run's trainers get: `off_policy` resolved against the run's schedule, and
    `lr_decay_steps` 0 resolved to the run's steps."""
    return dataclasses.replace(cfg.train, off_policy=resolved_off_policy(cfg),
                               lr_decay_steps=cfg.train.lr_decay_steps or cfg.run.steps)


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def env(name: str, default: str | None = None) -> str | None:
    """The one sanctioned read of the process environment (Slurm, MPI, user overrides)."""
    return os.environ.get(name, default)


def initial_model(cfg: GyreConfig) -> str:
    """The model a run starts from (model.init_from, else model.path); empty = the tiny model."""
    return cfg.model.init_from or cfg.model.path


def default_tiny_dir(cfg: GyreConfig) -> Path:
    if cfg.model.tiny_dir:
        return Path(cfg.model.tiny_dir)
    base = env("GYRE_CACHE") or str(Path(env("HOME") or "/tmp") / ".cache" / "gyre")
    family = cfg.model.tiny_family
    return Path(base) / ("tiny-qwen" if family == "qwen2" else f"tiny-{family.replace('_', '-')}")
