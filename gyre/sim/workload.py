"""Workloads for the simulator: groups of executions, each with calls, tokens and tool time.

An execution is what it does, not how long it took: its model calls, the tokens it decodes
(``output_tokens``) and the new tokens it prefills (``prefill_tokens``: tool results, prompts),
the time its tools take between calls (``tool_s``), the context it reaches, and what it costs to
train. How long it takes is an *output* of the simulation (tool time + prefill + decode at the
load the run puts on the rollout cells, plus re-prefills after lost caches). ``nominal_s`` is the
duration the profile assigns it (the paper's measured distribution) and only ever serves as a
check and as a prior for policies.

Trace schema (CSV with a header, or JSON: a list of objects, or ``{"executions": [...]}``):

    execution_id   str/int  unique per execution
    group          str/int  task/group id; executions of one group train together
    duration_s     float    wall time of the execution as recorded (nominal_s)
    calls          int      model calls it made
    tokens         int      tokens it processed (new input + output over all calls)
    train_tokens   int      optional: tokens it contributes to training (default: ``tokens``)
    context_tokens int      optional: its context length at the end (default 0)
    output_tokens  int      optional: tokens decoded (default: OUTPUT_SHARE x tokens)
    tool_s         float    optional: tool/environment seconds (default: TOOL_SHARE x duration_s)

``prefill_tokens`` is ``tokens - output_tokens``. A later exporter writes this from the execution
table of Gyre's HDF5 shards.
"""

from __future__ import annotations

import csv
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gyre.config import ConfigError

HOUR = 3600.0
# Defaults for traces that record only durations and token totals (stated assumptions, the same
# as the NL2REPO preset's): 30% of processed tokens are decoded, 60% of the wall time is tools.
OUTPUT_SHARE = 0.3
TOOL_SHARE = 0.6


@dataclass(frozen=True, slots=True)
class ExecSpec:
    nominal_s: float       # the profile's duration for it (a check and a prior, never simulated time)
    calls: int
    tokens: float          # processed: new input + output
    train_tokens: float
    context_tokens: float = 0.0  # context length when it ends (grows linearly over the execution)
    output_tokens: float = 0.0   # decoded
    tool_s: float = 0.0          # tool/environment time between its calls

    @property
    def prefill_tokens(self) -> float:
        return max(0.0, self.tokens - self.output_tokens)


@dataclass(frozen=True, slots=True)
class GroupSpec:
    key: str
    execs: tuple[ExecSpec, ...]


@dataclass(frozen=True)
class LognormalPreset:
    """Two-level lognormal: a task factor shared by the group times an execution factor.

    log d = mu + sigma_task * z_task + sigma_exec * z_exec, with mu set so E[d] = mean_duration_s
    (the nominal duration). Calls, tokens, tool time and training tokens scale with the same
    factor (longer executions talk more and run more tools). ``train_cost`` multiplies the
    training tokens (how many tokens one trained execution costs: x1 = its trajectory once).
    """
    name: str
    mean_duration_s: float
    sigma_task: float
    sigma_exec: float
    mean_calls: float
    mean_tokens: float
    mean_train_tokens: float
    group_size: int
    mean_context_tokens: float = 0.0  # context length at an execution's end (scales with duration)
    output_share: float = OUTPUT_SHARE  # share of processed tokens that are decoded
    mean_tool_s: float = 0.0            # tool/environment seconds per execution
    train_cost: float = 1.0             # training tokens per execution = mean_train_tokens x this

    def __post_init__(self) -> None:
        for name in ("mean_duration_s", "mean_calls", "mean_tokens", "mean_train_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"workload {self.name}: {name} must be positive")
        if self.sigma_task < 0 or self.sigma_exec < 0:
            raise ConfigError(f"workload {self.name}: sigmas must be >= 0")
        if self.group_size < 1:
            raise ConfigError(f"workload {self.name}: group_size must be >= 1")
        if not 0.0 < self.output_share <= 1.0:
            raise ConfigError(f"workload {self.name}: output_share must be within (0, 1]")
        if self.mean_tool_s < 0 or self.train_cost <= 0:
            raise ConfigError(f"workload {self.name}: mean_tool_s must be >= 0 and train_cost positive")

    @property
    def mu(self) -> float:
        return math.log(self.mean_duration_s) - (self.sigma_task ** 2 + self.sigma_exec ** 2) / 2

    @property
    def sigma(self) -> float:
        """Spread of one execution's log-duration (both levels)."""
        return math.hypot(self.sigma_task, self.sigma_exec)


# The paper's NL2RepoBench profile of the 122B model: mean rollout 1.93 h; mean over queries of
# the slowest of G = 8 rollouts 2.96 h; 9.51% of queries with a slowest rollout >= 4 h. sigma_task
# and sigma_exec are the two shape parameters fitted to these three workload figures (Monte Carlo,
# 400k groups; never to an end-to-end time); the preset gives 1.93 h / 2.96 h / 9.3%. "Hundreds of
# calls, about 1M tokens per execution" (paper): 300 calls, 1M tokens processed (new input +
# output). Assumed: 30% of them decoded (300K output tokens: the agent writes a repository). Tool
# time is what the token counts cannot give: pinned so the preset's E0 run averages the profile's
# 1.93 h; the share of time spent waiting on the model is then an output of the simulation. 700K training tokens per rollout (paper, 2.4T run); context at the end 128K tokens
# (assumed: linear growth gives a 64K mean, the median input length of NVIDIA Dynamo's agentic
# recipe for Qwen3.5-122B-A10B).
# The preset's point of the family consistent with the paper's secondary figures
# (benchmarks/bench_nl2repo.py: consistent_family): 256 groups per step (calibration.P122B), a
# training cost of 1.97 x 700K tokens per execution (slack 20.85%, 8x4 vs 4x8 within 2.2%), and the
# tool time at which that run's E0 averages 1.93 h (gyre.sim.scenario.pin_tool_time).
PINNED_TOOL_S = 3707.0
PINNED_TRAIN_COST = 1.97
NL2REPO = LognormalPreset(
    name="nl2repo-122b-32n", mean_duration_s=1.93 * HOUR, sigma_task=0.155, sigma_exec=0.3225,
    mean_calls=300, mean_tokens=1.0e6, mean_train_tokens=7.0e5, group_size=8,
    mean_context_tokens=1.28e5, output_share=OUTPUT_SHARE, mean_tool_s=PINNED_TOOL_S, train_cost=PINNED_TRAIN_COST,
)

# The 2.4T run: no duration profile is published for it. Assumed: the 122B profile's shape, calls,
# tokens and tool time (DURATION_SCALE_2P4T scales the tool time), 700K training tokens per
# rollout (paper). Its decode is slower (a larger model), so its executions run longer.
DURATION_SCALE_2P4T = 1.0
NL2REPO_2P4T = LognormalPreset(
    name="nl2repo-2.4t", mean_duration_s=1.93 * HOUR * DURATION_SCALE_2P4T, sigma_task=0.155,
    sigma_exec=0.3225, mean_calls=300, mean_tokens=1.0e6, mean_train_tokens=7.0e5, group_size=8,
    mean_context_tokens=1.28e5, output_share=OUTPUT_SHARE,
    mean_tool_s=PINNED_TOOL_S * DURATION_SCALE_2P4T, train_cost=PINNED_TRAIN_COST,
)

PRESETS = {"nl2repo": NL2REPO, NL2REPO.name: NL2REPO, NL2REPO_2P4T.name: NL2REPO_2P4T}


class Workload:
    """An endless, deterministic supply of groups: group i is the same for a given seed."""

    def __init__(self, groups_fn, group_size: int, name: str, mean_duration_s: float, sigma: float) -> None:
        self._fn = groups_fn
        self.group_size = group_size
        self.name = name
        self.mean_duration_s = mean_duration_s
        self.sigma = sigma  # log-duration spread, a prior for policies' remaining-work estimates
        self._cache: dict[int, GroupSpec] = {}

    def group(self, i: int) -> GroupSpec:
        g = self._cache.get(i)
        if g is None:
            g = self._cache[i] = self._fn(i)
        return g

    @classmethod
    def from_preset(cls, p: LognormalPreset, seed: int) -> "Workload":
        mu = p.mu

        def make(i: int) -> GroupSpec:
            rng = np.random.default_rng((seed, i))  # per group: independent of visit order
            zt = rng.standard_normal()
            ze = rng.standard_normal(p.group_size)
            d = np.exp(mu + p.sigma_task * zt + p.sigma_exec * ze)
            scale = d / p.mean_duration_s
            execs = tuple(ExecSpec(nominal_s=float(di), calls=max(1, int(round(p.mean_calls * s))),
                                   tokens=float(p.mean_tokens * s),
                                   train_tokens=float(p.mean_train_tokens * p.train_cost * s),
                                   context_tokens=float(p.mean_context_tokens * s),
                                   output_tokens=float(p.mean_tokens * p.output_share * s),
                                   tool_s=float(p.mean_tool_s * s))
                          for di, s in zip(d, scale))
            return GroupSpec(key=f"{p.name}-{i}", execs=execs)

        return cls(make, p.group_size, p.name, p.mean_duration_s, p.sigma)

    @classmethod
    def from_trace(cls, path: str | Path) -> "Workload":
        """Groups in first-seen order; a run needing more groups than the trace holds wraps around."""
        rows = read_trace(path)
        by_group: dict[str, list[ExecSpec]] = {}
        for r in rows:
            by_group.setdefault(r["group"], []).append(ExecSpec(
                r["duration_s"], r["calls"], r["tokens"], r["train_tokens"], r["context_tokens"],
                r["output_tokens"], r["tool_s"]))
        sizes = {len(v) for v in by_group.values()}
        if len(sizes) != 1:
            raise ConfigError(f"trace {path}: groups must all have the same size, found sizes {sorted(sizes)}")
        groups = [GroupSpec(k, tuple(v)) for k, v in by_group.items()]
        durs = np.array([e.nominal_s for g in groups for e in g.execs])
        logs = np.log(durs)
        return cls(lambda i: groups[i % len(groups)], sizes.pop(), Path(path).name,
                   float(durs.mean()), float(logs.std()) if len(logs) > 1 else 0.0)

    @classmethod
    def named(cls, preset_or_path: "str | LognormalPreset", seed: int) -> "Workload":
        """A preset's workload is made once per process and shared (its groups are a pure function
        of the preset and seed, so the runs of a sweep draw them once); a trace is read each time."""
        if isinstance(preset_or_path, LognormalPreset):
            return _preset_workload(preset_or_path, seed)
        if preset_or_path in PRESETS:
            return _preset_workload(PRESETS[preset_or_path], seed)
        if Path(preset_or_path).is_file():
            return cls.from_trace(preset_or_path)
        raise ConfigError(f"workload {preset_or_path!r}: not a preset ({', '.join(PRESETS)}) nor a trace file")


@functools.lru_cache(maxsize=8)
def _preset_workload(p: LognormalPreset, seed: int) -> Workload:
    return Workload.from_preset(p, seed)


_FIELDS = ("execution_id", "group", "duration_s", "calls", "tokens")


def read_trace(path: str | Path) -> list[dict]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"trace {p} does not exist") from None
    if p.suffix.lower() == ".json":
        data = json.loads(text)
        raw = data["executions"] if isinstance(data, dict) else data
    else:
        raw = list(csv.DictReader(text.splitlines()))
    if not raw:
        raise ConfigError(f"trace {p}: no executions")
    out, seen = [], set()
    for n, r in enumerate(raw, 1):
        missing = [f for f in _FIELDS if f not in r or r[f] in ("", None)]
        if missing:
            raise ConfigError(f"trace {p} row {n}: missing {', '.join(missing)}")
        try:
            row = {"execution_id": str(r["execution_id"]), "group": str(r["group"]),
                   "duration_s": float(r["duration_s"]), "calls": int(r["calls"]),
                   "tokens": float(r["tokens"])}
            tt = r.get("train_tokens")
            row["train_tokens"] = float(tt) if tt not in (None, "") else row["tokens"]
            ct = r.get("context_tokens")
            row["context_tokens"] = float(ct) if ct not in (None, "") else 0.0
            ot = r.get("output_tokens")
            row["output_tokens"] = float(ot) if ot not in (None, "") else row["tokens"] * OUTPUT_SHARE
            ts = r.get("tool_s")
            row["tool_s"] = float(ts) if ts not in (None, "") else row["duration_s"] * TOOL_SHARE
        except (TypeError, ValueError) as e:
            raise ConfigError(f"trace {p} row {n}: {e}") from None
        if (row["duration_s"] <= 0 or row["calls"] < 0 or row["tokens"] < 0 or row["train_tokens"] < 0
                or row["context_tokens"] < 0 or row["tool_s"] < 0 or row["output_tokens"] < 0):
            raise ConfigError(f"trace {p} row {n}: durations must be positive and counts >= 0")
        if row["output_tokens"] > row["tokens"]:
            raise ConfigError(f"trace {p} row {n}: output_tokens {row['output_tokens']:g} exceed tokens "
                              f"{row['tokens']:g} (tokens counts input and output)")
        if row["execution_id"] in seen:
            raise ConfigError(f"trace {p} row {n}: duplicate execution_id {row['execution_id']}")
        seen.add(row["execution_id"])
        out.append(row)
    return out


def write_trace(path: str | Path, groups: list[GroupSpec]) -> None:
    """Write groups in the trace schema (CSV or JSON by suffix); the inverse of read_trace."""
    rows = [{"execution_id": f"{g.key}/{j}", "group": g.key, "duration_s": e.nominal_s,
             "calls": e.calls, "tokens": e.tokens, "train_tokens": e.train_tokens,
             "context_tokens": e.context_tokens, "output_tokens": e.output_tokens, "tool_s": e.tool_s}
            for g in groups for j, e in enumerate(g.execs)]
    p = Path(path)
    if p.suffix.lower() == ".json":
        p.write_text(json.dumps({"executions": rows}, indent=1), encoding="utf-8")
    else:
        with p.open("w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
