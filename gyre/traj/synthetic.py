"""Synthetic executions with a settable shape, built through the real ``TrajectoryTree.add_call``.

Each call sends what an OpenAI-style agent harness would send, rendered the way the proxy
renders ChatML: one segment per message, keyed by a hash of the message, and the previous
outputs re-sent with their exact ids. The events that branch a tree are modelled on real runs:

* main conversation: system + task, then per call the assistant output and the tool result
  (two results when the model called two tools at once);
* sub-agent (``subagent:<name>``): a main output that delegates; the sub-agent runs its own
  conversation under its own system prompt (a new root) and its answer comes back as the tool
  result;
* compaction: a ``compactor`` call over the whole conversation plus a summarise request, after
  which the main conversation restarts from system + task + the summary;
* retry: the same input sent again (the first output was cut off), a different output kept.

Events are spread evenly over the main calls, so a shape fixes the node counts; the seed only
changes token lengths and ids. Token ids follow a Zipf law (real text does; it matters for
compression figures), with BPE-like low ids for frequent tokens.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace

import numpy as np

from gyre.traj.record import ExecutionRecord
from gyre.traj.tree import Segment, TrajectoryTree

# Qwen2 ChatML ids: <|im_start|>, <|im_end|>, "\n" and the role words
IM_START, IM_END, NL = 151644, 151645, 198
ROLE_IDS = {"system": 8948, "user": 872, "assistant": 77091, "tool": 14172}
VOCAB = 151643  # ordinary (non-special) token ids are below this
GEN_PROMPT = np.array([NL, IM_START, ROLE_IDS["assistant"], NL], np.int32)


@dataclass(frozen=True)
class Lengths:
    """Message length in content tokens: log-normal around ``median``, clipped to [lo, hi]."""

    median: float
    sigma: float = 0.8
    lo: int = 1
    hi: int = 16384

    def sample(self, rng: np.random.Generator) -> int:
        return int(np.clip(round(self.median * np.exp(self.sigma * rng.standard_normal())), self.lo, self.hi))


@dataclass(frozen=True)
class Shape:
    calls: int = 48                  # all model calls: main, retries, compactor, sub-agents
    subagents: int = 1               # sub-agent runs, each under its own root
    subagent_calls: int = 6          # calls per sub-agent run
    subagent_names: tuple[str, ...] = ("explore", "test", "review")
    compactions: int = 1
    retries: int = 1
    retry_phase: float = 0.3         # where in its even stretch of main calls a retry falls (0..1)
    parallel_every: int = 0          # every N-th main step calls two tools at once (0: never)
    system: Lengths = Lengths(2000, 0.1)
    task: Lengths = Lengths(800, 0.5)
    assistant: Lengths = Lengths(160, 0.9)
    tool: Lengths = Lengths(320, 1.1)
    summary: Lengths = Lengths(1200, 0.3)
    zipf: float = 1.2                # token-frequency exponent
    versions_every: int = 0          # policy version + 1 every N calls (0: one version)
    seed: int = 0

    @property
    def main_calls(self) -> int:
        return self.calls - self.retries - self.compactions - self.subagents * self.subagent_calls

    def validate(self) -> None:
        events = self.subagents + self.compactions + self.retries
        if min(self.subagents, self.compactions, self.retries) < 0 or (
                self.subagents and self.subagent_calls < 1):
            raise ValueError(f"negative counts in {self}")
        if self.main_calls < max(1, self.compactions + 1, events):
            raise ValueError(f"{self.calls} calls cannot hold {self.main_calls} main calls for "
                             f"{events} events; raise calls or lower the events")


# The paper's case study: ~636 calls and 10 candidate trajectories (3 compactor branches, the
# final main branch, 3 sub-agent runs, 3 abandoned retries). Parallel tool calls and the retry
# phase are set so the counts land on the reported 1,347 unique vs 1,716 expanded nodes
# (this gives 1,348 vs 1,717); a policy update every 64 calls spans versions 0..9.
CASE_STUDY = Shape(calls=636, subagents=3, subagent_calls=40, compactions=3, retries=3,
                   retry_phase=0.325, parallel_every=7, versions_every=64)


def scaled(shape: Shape, factor: float) -> Shape:
    """The same shape (calls, branches, events) with every message ``factor`` times longer: the
    executions behind the xLong measurements (0.25M .. 2M processed tokens, `bench_xlong`)."""
    if not factor > 0:
        raise ValueError(f"scale factor must be > 0, got {factor}")

    def grow(x: Lengths) -> Lengths:
        return replace(x, median=x.median * factor, hi=max(x.lo, int(round(x.hi * factor))))

    return replace(shape, system=grow(shape.system), task=grow(shape.task), assistant=grow(shape.assistant),
                   tool=grow(shape.tool), summary=grow(shape.summary))


def processed_tokens(record: ExecutionRecord) -> int:
    """Tokens an execution processed: each call's new input plus its output, i.e. every token
    of its tree once (the paper's "about 1M tokens processed" per xLong execution)."""
    return int(sum(len(n.tokens) for n in record.tree.nodes))


def _key(role: str, content: np.ndarray) -> str:
    return hashlib.blake2b(role.encode() + content.tobytes(), digest_size=12).hexdigest()


def _render(role: str, content: np.ndarray, first: bool) -> np.ndarray:
    # "\n" separates messages and is carried by the following one, so a re-sent assistant
    # message is exactly generation prompt + sampled output (token truth)
    head = [IM_START, ROLE_IDS[role], NL] if first else [NL, IM_START, ROLE_IDS[role], NL]
    return np.concatenate([np.array(head, np.int32), content, np.array([IM_END], np.int32)])


@dataclass
class _Builder:
    shape: Shape
    rng: np.random.Generator
    tree: TrajectoryTree = field(default_factory=TrajectoryTree)
    clock: float = 0.0

    def content(self, lengths: Lengths) -> np.ndarray:
        n = lengths.sample(self.rng)
        return ((self.rng.zipf(self.shape.zipf, n) - 1) % VOCAB).astype(np.int32)

    def message(self, role: str, lengths: Lengths | None = None, content: np.ndarray | None = None,
                first: bool = False) -> Segment:
        c = self.content(lengths) if content is None else content
        return Segment(_key(role, c), _render(role, c, first), role)

    def call(self, conv: list[Segment], agent_role: str, out: Lengths, finish: str = "stop") -> Segment:
        """One model call over ``conv``; returns the output as the segment a harness re-sends."""
        content = self.content(out)
        output = np.concatenate([content, np.array([IM_END], np.int32)])
        logprobs = -self.rng.exponential(0.4, len(output)).astype(np.float32)
        index = len(self.tree.calls)
        pv = index // self.shape.versions_every if self.shape.versions_every else 0
        n_in = sum(len(s.tokens) for s in conv) + len(GEN_PROMPT)
        t0 = self.clock
        self.clock += 0.05 + 2e-5 * n_in + 0.02 * len(output)  # prefill + decode
        key = _key("assistant", content)
        self.tree.add_call(conv, key, GEN_PROMPT, output, logprobs, agent_role=agent_role,
                           weight_version=str(pv), policy_version=pv,
                           endpoint=f"http://cell-{int(self.rng.integers(2))}:30000",
                           finish_reason=finish, t_start=t0, t_end=self.clock)
        self.clock += float(self.rng.lognormal(0.0, 1.0))  # the harness runs a tool
        return Segment(key, np.concatenate([GEN_PROMPT, output]), "assistant")

    def subagent(self, name: str, system: Segment, brief: Segment) -> np.ndarray:
        """A sub-agent run under its own root; returns its final answer's content."""
        s = self.shape
        conv = [system, brief]
        for j in range(s.subagent_calls):
            out = self.call(conv, f"subagent:{name}", s.assistant)
            if j + 1 < s.subagent_calls:
                conv += [out, self.message("tool", s.tool)]
        return out.tokens[len(GEN_PROMPT):-1]


def _event_calls(n_events: int, main: int, offset: float) -> list[int]:
    """Main-call indices for ``n_events`` events spread evenly over ``main`` calls."""
    return [min(main - 1, int((k + offset) * main / max(n_events, 1))) for k in range(n_events)]


def generate(shape: Shape, *, execution_id: str | None = None, task: str = "synthetic-task",
             group: int = 0, t0: float = 0.0) -> ExecutionRecord:
    """One finished, evaluated execution with a tree of the given shape."""
    shape.validate()
    rng = np.random.default_rng(shape.seed)
    b = _Builder(shape, rng, clock=t0)
    main = shape.main_calls
    compact_after = set(int((k + 1) * main / (shape.compactions + 1)) - 1 for k in range(shape.compactions))
    delegate_at = dict(zip(_event_calls(shape.subagents, main, 0.5), range(shape.subagents)))
    retry_at = set(_event_calls(shape.retries, main, shape.retry_phase))
    # events must be distinct, and a delegation needs a main call after it to return to
    if (len(compact_after) < shape.compactions or len(delegate_at) < shape.subagents
            or len(retry_at) < shape.retries or max(delegate_at, default=-1) >= main - 1):
        raise ValueError(f"{main} main calls are too few to spread the events of {shape}")

    system = b.message("system", shape.system, first=True)
    task_msg = b.message("user", shape.task)
    compact_req = b.message("user", Lengths(60, 0.0))
    sub_systems = {n: b.message("system", shape.system, first=True) for n in shape.subagent_names}
    conv = [system, task_msg]
    for i in range(main):
        if i in retry_at:  # first sample cut off at the length limit; the harness asks again
            b.call(conv, "main", replace(shape.assistant, median=shape.assistant.median * 4), "length")
        out = b.call(conv, "main", shape.assistant)
        if i == main - 1:
            break
        if i in delegate_at:
            name = shape.subagent_names[delegate_at[i] % len(shape.subagent_names)]
            brief = b.message("user", content=out.tokens[len(GEN_PROMPT):-1])
            answer = b.subagent(name, sub_systems[name], brief)
            conv += [out, b.message("tool", content=answer)]
        else:
            conv += [out, b.message("tool", shape.tool)]
            if shape.parallel_every and i % shape.parallel_every == shape.parallel_every - 1:
                conv.append(b.message("tool", shape.tool))
        if i in compact_after:
            summary = b.call(conv + [compact_req], "compactor", shape.summary)
            conv = [system, task_msg, b.message("user", content=summary.tokens[len(GEN_PROMPT):-1])]

    total = int(rng.integers(5, 41))
    passed = int(rng.binomial(total, 0.5))
    return ExecutionRecord(
        execution_id=execution_id or f"synthetic-{shape.seed}", task=task, group=group,
        status="done", reward=passed / total, reward_source="tests", passed=passed, total=total,
        t_start=t0, t_end=b.clock, workspace=f"workspaces/{execution_id or f'synthetic-{shape.seed}'}",
        tree=b.tree)


def generate_group(shape: Shape, n: int, *, task: str = "synthetic-task", group: int = 0,
                   t0: float = 0.0) -> list[ExecutionRecord]:
    """``n`` executions of one task (seeds shape.seed .. shape.seed + n - 1)."""
    return [generate(replace(shape, seed=shape.seed + k), execution_id=f"{task}-g{group}-e{k}",
                     task=task, group=group, t0=t0) for k in range(n)]


def case_study(seed: int = 0, **record: object) -> ExecutionRecord:
    """One execution with the paper's case-study shape (see ``CASE_STUDY``)."""
    return generate(replace(CASE_STUDY, seed=seed), **record)  # type: ignore[arg-type]
