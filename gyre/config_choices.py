"""The words a Gyre configuration is made of: its error, and every choice key's StrEnum.

Ground floor of gyre.config (which re-exports each name: ``from gyre.config import Scheme`` is the
way to use them): imports nothing of Gyre, so the typed sections and any module that only needs
a choice stand on it without the sections' weight.
"""

from __future__ import annotations

import typing
from enum import Enum, StrEnum
from typing import Any


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type, or out of range."""


class Scheme(StrEnum):
    """`sched.scheme`: how cells are split between rollout and training."""
    E = "E"                  # elastic, demand-sized (gyre/sched/elastic.py)
    E_PAPER = "E-paper"      # the paper's elastic rule (gyre/sched/elastic_paper.py)
    A = "A"                  # async pools
    C = "C"                  # colocate


class StalenessRule(StrEnum):
    """`sched.staleness_rule`: how the lag bound k admits groups."""
    WINDOW = "window"        # a group lagging more than k syncs is dropped (and replaced)
    COUNT = "count"          # AReaL's rule: at sync r at most (r+k+1) x groups-per-round started


class EngineBackend(StrEnum):
    """`engine.backend`: each value is a module of gyre/engine/backends/ (the one table)."""
    EMBEDDED = "embedded"
    SGLANG = "sglang"
    VLLM = "vllm"


class TrainBackend(StrEnum):
    EMBEDDED = "embedded"
    MEGATRON = "megatron"


def _choices(name: str, doc: str, *values: str) -> type[StrEnum]:
    """A StrEnum whose members are `values` (upper-cased names, '-' as '_'): one line per key."""
    kind = StrEnum(name, [(v.upper().replace("-", "_"), v) for v in values])
    kind.__doc__ = doc
    kind.__module__ = __name__  # pickles (submitit, the trainer pipe) find it here
    return kind


WandbMode = _choices("WandbMode", "`run.wandb_mode`", "offline", "online", "disabled")
BestMode = _choices("BestMode", "`run.best_metric_mode`", "max", "min")
InitOptimizer = _choices("InitOptimizer", "`model.init_optimizer`", "fresh", "carried")
TemplateSource = _choices("TemplateSource", "`proxy.chat_template`", "builtin", "model")
History = _choices("History", "`proxy.history`", "exact", "template")
ToolParser = _choices("ToolParser", "`proxy.tool_parser`", "hermes", "qwen3_coder", "llama3", "none")
ReasoningParser = _choices("ReasoningParser", "`proxy.reasoning_parser`", "none", "qwen3")
Compression = _choices("Compression", "`store.compression`", "gzip", "lzf", "none")
Layout = _choices("Layout", "`train.layout`", "tree", "expanded")
Advantage = _choices("Advantage", "`train.advantage`", "grpo", "rloo", "reward")
OffPolicyMode = _choices("OffPolicyMode", "`train.off_policy`", "auto", "none", "tis", "decoupled")
Dtype = _choices("Dtype", "`train.dtype`", "auto", "float32", "bfloat16")
BurstOrder = _choices("BurstOrder", "`sched.burst_order`", "stream", "shuffle")
Sandbox = _choices("Sandbox", "`harness.sandbox`", "auto", "bwrap", "none")
ImageRuntime = _choices("ImageRuntime", "`harness.runtime`", "auto", "bwrap", "apptainer", "singularity", "enroot",
                        "podman", "docker")
SandboxNetwork = _choices("SandboxNetwork", "`harness.sandbox_network`", "proxy", "host")
ResumeMode = _choices("ResumeMode", "`harness.resume`", "replay", "restart")
EvalNetwork = _choices("EvalNetwork", "`eval.network`", "auto", "on", "off")
EvalExecutor = _choices("EvalExecutor", "`eval.executor`", "pool", "submitit-local", "submitit-slurm")
EvalOutput = _choices("EvalOutput", "`eval.output`", "official", "merged")
LrSchedule = _choices("LrSchedule", "`train.lr_schedule`", "constant", "linear", "cosine")
KlEstimator = _choices("KlEstimator", "`train.kl_estimator`", "k1", "k2", "k3")
DatasetFormat = _choices("DatasetFormat", "`dataset.format`", "auto", "jsonl", "parquet", "hf")
SamplingPolicy = _choices("SamplingPolicy", "`proxy.sampling`", "harness", "fix", "clamp", "refuse")


def enum_value(key: str, value: Any, kind: type[Enum]) -> Any:
    """``value`` as a member of ``kind``, or a ConfigError naming the key, the value and the choices."""
    try:
        return kind(value)
    except ValueError:
        raise ConfigError(f"{key}: {value!r} is not allowed; choose one of "
                          f"{', '.join(m.value for m in kind)}") from None


class _EnumFields:
    """Fields typed as an Enum hold members however the section was built (a file, an override,
    or a constructor call in code or tests): a string is converted, a bad one refused."""
    _SECTION = ""

    def __setattr__(self, name: str, value: Any) -> None:
        kind = _enum_fields(type(self)).get(name)
        if kind is not None and not isinstance(value, kind):
            value = enum_value(f"{self._SECTION}.{name}", value, kind)
        super().__setattr__(name, value)


def _enum_fields(cls: type) -> dict[str, type[Enum]]:
    found = cls.__dict__.get("_enum_kinds")
    if found is None:
        hints = typing.get_type_hints(cls)
        found = {n: t for n, t in hints.items() if isinstance(t, type) and issubclass(t, Enum)}
        cls._enum_kinds = found
    return found
