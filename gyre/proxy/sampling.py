"""The run's say over how training executions sample: `proxy.sampling` and the token budget.

Both act on a call after its OpenAI parameters are parsed (gyre.proxy.params) and before the
engine is asked: the policy changes or refuses temperature/top_p, the budget cuts max_new_tokens
to what the execution has left and refuses calls once it is spent (docs/openai.md, 'Sampling
policy and token budget'). The execution then ends as timed out and is scored as a timeout is
(gyre.services.rollout), its harness ended soon after its first refused call.
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre.proxy.params import CallParams, RequestError


SAMPLING_POLICIES = ("harness", "fix", "clamp", "refuse")


@dataclass(frozen=True)
class SamplingPolicy:
    """`proxy.sampling`: who decides a training execution's temperature and top_p.

    A harness that sends temperature 0 to a training run gets G identical executions per group,
    zero advantage, and the group is replaced: silently wasted rollouts. The policy makes the
    choice the run's: `fix` samples every call at (temperature, top_p); `clamp` moves the
    harness's values into [temperature_min, temperature_max] x [top_p_min, 1]; `refuse` answers a
    call outside those bounds with a 400 naming the bound. Greedy requests (temperature 0, or
    top_p 0, which OpenAI defines as greedy) count as temperature 0. What was applied is what the
    engine samples with, stored with every call (its `temperature`, `top_p`: the trainer divides
    by that temperature); what the harness asked, where it differs, is in the call's answer
    (`gyre.sampling.requested`) and counted per execution.
    """
    mode: str = "harness"
    temperature: float = 1.0
    top_p: float = 1.0
    temperature_min: float = 0.0
    temperature_max: float = 2.0
    top_p_min: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in SAMPLING_POLICIES:
            raise ValueError(f"proxy.sampling {self.mode!r}: choose one of {', '.join(SAMPLING_POLICIES)}")
        if self.temperature_min > self.temperature_max:
            raise ValueError(f"proxy.temperature_min ({self.temperature_min}) must not exceed "
                             f"proxy.temperature_max ({self.temperature_max})")

    @classmethod
    def from_config(cls, proxy_cfg) -> "SamplingPolicy":
        p = proxy_cfg
        return cls(str(p.sampling), p.temperature, p.top_p, p.temperature_min, p.temperature_max, p.top_p_min)

    def apply(self, p: CallParams) -> CallParams:
        """`p` with the policy's temperature and top_p (`requested` set where they changed), or a
        RequestError (refuse) naming what is out of bounds."""
        t, top = p.temperature, p.top_p
        if self.mode == "harness":
            return p
        if self.mode == "fix":
            t, top = self.temperature, self.top_p
        elif self.mode == "clamp":
            t = min(max(t, self.temperature_min), self.temperature_max)
            top = max(top, self.top_p_min)
        else:  # refuse
            if not self.temperature_min <= t <= self.temperature_max:
                raise RequestError(400, f"temperature {t:g}{' (greedy)' if t == 0 else ''} is outside what this "
                                        f"training run samples at, [{self.temperature_min:g}, "
                                        f"{self.temperature_max:g}] (proxy.temperature_min/max; proxy.sampling = "
                                        "refuse): send a temperature in that range or leave it out",
                                   param="temperature", code="sampling_refused")
            if top < self.top_p_min:
                raise RequestError(400, f"top_p {top:g} is below what this training run samples with, "
                                        f"{self.top_p_min:g} (proxy.top_p_min; proxy.sampling = refuse)",
                                   param="top_p", code="sampling_refused")
        if (t, top) == (p.temperature, p.top_p):
            return p
        p.requested = {"temperature": p.temperature, "top_p": p.top_p}
        p.temperature, p.top_p = t, top
        return p


def budget_left(sess, budget: int) -> int | None:
    """Sampled tokens `sess` (an ExecutionSession) may still use, None without a budget; a 400
    (`token_budget_exhausted`) once none are left. The first refused call also tells
    `sess.on_budget_spent` (once): the rollout service then ends the harness as its time limit
    would unless it ends by itself first (HarnessPool.end_as_timeout), so one that keeps calling
    (or retries) does not run on until `harness.timeout_s`. Not at the call that reaches the
    budget: the harness has that answer and may still act on it."""
    if not budget:
        return None
    left = budget - sess.tokens_out
    if left <= 0 or sess.budget_spent:
        sess.budget_spent = True
        told, sess.on_budget_spent = sess.on_budget_spent, None
        if told is not None:
            told()
        raise RequestError(400, f"this execution has used its token budget of {budget} sampled tokens "
                                "(proxy.execution_token_budget): it ends here and is scored as a timeout",
                           code="token_budget_exhausted")
    return left


def count_call(sess, p: CallParams, sampled: int, budget: int) -> bool:
    """A recorded call's sampled tokens against the budget; True when its policy changed its sampling."""
    sess.tokens_out += sampled
    if budget and sess.tokens_out >= budget:
        sess.budget_spent = True
    if p.requested is not None:
        sess.sampling_changed += 1
        return True
    return False
