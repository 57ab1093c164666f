"""The run's sampling policy (proxy.sampling) and per-execution token budget, through the real
proxy on loopback with the real `openai` client and a scripted engine behind the real router."""

from __future__ import annotations

import openai
import pytest

from gyre.config import ConfigError, load_config
from gyre.proxy.sampling import SamplingPolicy
from support.proxy_stack import R, Stack

MSGS = [{"role": "user", "content": "Say hello."}]


@pytest.fixture
def stack():
    s = Stack()
    yield s
    s.close()


def sent_sampling(stack):
    return stack.engine.requests[-1]["sampling_params"]


def test_harness_values_by_default(stack):
    client, _ = stack.client()
    r = client.chat.completions.create(model="m", messages=MSGS, temperature=0.3, top_p=0.5)
    sp = sent_sampling(stack)
    assert (sp["temperature"], sp["top_p"]) == (0.3, 0.5)
    assert r.model_extra["gyre"]["sampling"] == {"temperature": 0.3, "top_p": 0.5}
    assert stack.proxy.sampling_changed == 0


def test_fix_overrides_greedy_and_records_what_was_asked(stack):
    stack.proxy.sampling = SamplingPolicy("fix", temperature=0.8, top_p=0.95)
    client, _ = stack.client()
    r = client.chat.completions.create(model="m", messages=MSGS, temperature=0)  # greedy: G identical samples
    sp = sent_sampling(stack)
    assert (sp["temperature"], sp["top_p"]) == (0.8, 0.95)
    call = stack.tree().calls[0]
    assert (call.temperature, call.top_p) == (0.8, 0.95)  # stored with the call: what training divides by
    assert r.model_extra["gyre"]["sampling"]["requested"] == {"temperature": 0.0, "top_p": 1.0}
    assert stack.proxy.by_id["e1"].sampling_changed == 1 and stack.proxy.sampling_changed == 1


def test_clamp_moves_values_into_bounds(stack):
    stack.proxy.sampling = SamplingPolicy("clamp", temperature_min=0.6, temperature_max=1.0, top_p_min=0.9)
    client, _ = stack.client()
    client.chat.completions.create(model="m", messages=MSGS, top_p=0)  # OpenAI: top_p 0 is greedy
    assert (sent_sampling(stack)["temperature"], sent_sampling(stack)["top_p"]) == (0.6, 1.0)
    client.chat.completions.create(model="m", messages=MSGS, temperature=1.7, top_p=0.5)
    assert (sent_sampling(stack)["temperature"], sent_sampling(stack)["top_p"]) == (1.0, 0.9)
    client.chat.completions.create(model="m", messages=MSGS, temperature=0.7)  # inside: untouched
    assert sent_sampling(stack)["temperature"] == 0.7
    assert stack.proxy.by_id["e1"].sampling_changed == 2


def test_refuse_names_the_bound(stack):
    stack.proxy.sampling = SamplingPolicy("refuse", temperature_min=0.5, temperature_max=1.2)
    client, _ = stack.client()
    n = len(stack.engine.requests)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=MSGS, temperature=0)
    assert "temperature_min" in str(e.value) and e.value.code == "sampling_refused"
    assert len(stack.engine.requests) == n and not stack.tree().calls  # never sampled, never recorded
    client.chat.completions.create(model="m", messages=MSGS, temperature=0.9)
    assert sent_sampling(stack)["temperature"] == 0.9


def test_a_validation_execution_keeps_its_own_policy(stack):
    stack.proxy.sampling = SamplingPolicy("fix", temperature=1.0)
    key = stack.proxy.register("val", task="t", sampling=SamplingPolicy())  # the harness's values
    client = openai.OpenAI(base_url=stack.base + "/v1", api_key=key, max_retries=0)
    client.chat.completions.create(model="m", messages=MSGS, temperature=0)
    assert sent_sampling(stack)["temperature"] == 0.0


def test_token_budget_cuts_the_last_call_then_refuses(stack):
    out = R.encode("Hello from the model, a long answer.") + [R.im_end]
    stack.engine.script = [out, out, out]
    stack.proxy.token_budget = len(out) + 3
    client, _ = stack.client()
    r1 = client.chat.completions.create(model="m", messages=MSGS)
    assert r1.usage.completion_tokens == len(out) and not stack.proxy.budget_spent("e1")
    r2 = client.chat.completions.create(model="m", messages=MSGS + [{"role": "user", "content": "more"}])
    assert sent_sampling(stack)["max_new_tokens"] == 3  # what was left
    assert r2.usage.completion_tokens == 3 and r2.choices[0].finish_reason == "length"
    assert stack.proxy.budget_spent("e1")
    n = len(stack.engine.requests)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=MSGS)
    assert e.value.code == "token_budget_exhausted" and "execution_token_budget" in str(e.value)
    assert len(stack.engine.requests) == n  # the engine was not asked
    assert sum(c.n_output for c in stack.tree().calls) == stack.proxy.token_budget


def test_config_keys():
    cfg = load_config(None, ["proxy.sampling=clamp", "proxy.temperature_min=0.5", "proxy.execution_token_budget=100"])
    pol = SamplingPolicy.from_config(cfg.proxy)
    assert (pol.mode, pol.temperature_min, pol.temperature_max) == ("clamp", 0.5, 2.0)
    assert load_config(None, []).proxy.sampling == "harness"  # off by default
    with pytest.raises(ConfigError, match="temperature_min"):
        load_config(None, ["proxy.temperature_min=1.5", "proxy.temperature_max=1.0"])
    with pytest.raises(ConfigError, match="proxy.sampling"):
        load_config(None, ["proxy.sampling=greedy"])


# A harness that writes a solution, then calls the model until the proxy refuses, then exits 3
# (as a harness does when its API errors): the execution still ends as a timeout.
AGENT = r'''
import json, os, sys, urllib.error, urllib.request
open("fizzbuzz.py", "w").write("def fizzbuzz(n):\n    return 'x'\n")
for i in range(50):
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", method="POST",
        data=json.dumps({"model": "m", "messages": [{"role": "user", "content": "go %d" % i}]}).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
    try:
        urllib.request.urlopen(req, timeout=30).read()
    except urllib.error.HTTPError as e:
        print(json.loads(e.read())["error"]["code"], file=sys.stderr)
        sys.exit(3)
'''


def test_an_execution_past_its_budget_is_scored_as_a_timeout(stack, tmp_path):
    import sys
    import warnings

    from gyre.config import GyreConfig
    from gyre.harness.evaluator import EvalOptions, EvaluatorPool
    from gyre.harness.runner import HarnessPool
    from gyre.harness.sandbox import Environments, SandboxConfig
    from gyre.harness.tasks import load_suite
    from gyre.services.rollout import RolloutService

    task = {t.name: t for t in load_suite("builtin")}["fizzbuzz"]
    (tmp_path / "agent.py").write_text(AGENT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        envs = Environments(SandboxConfig(sandbox="none"))
    out = R.encode("Hello from the model.") + [R.im_end]
    stack.engine.script = [out] * 50
    stack.proxy.token_budget = 2 * len(out) + 1  # the third call is cut to 1 token, the fourth refused
    service = RolloutService(GyreConfig(), envs, "unused", {"model_hash": "m" * 8, "tokenizer_hash": "t" * 8},
                             tmp_path / "shards")
    service.proxy, service.base_url = stack.proxy, stack.base + "/v1"
    service.pool = HarnessPool(tmp_path / "run", [sys.executable, str(tmp_path / "agent.py")], environments=envs)
    service.evaluators = EvaluatorPool(EvalOptions(timeout_s=60, scratch_dir=str(tmp_path / "scratch")), workers=1,
                                       workspaces_root=tmp_path / "run" / "workspaces")
    try:
        rec = stack.lt.run(service.execute(task, "fizzbuzz-g0-a0", 0))
    finally:
        service.evaluators.shutdown()
    assert rec.status == "timeout" and "execution_token_budget" in rec.error
    assert rec.reward_source == "tests-after-timeout" and rec.total > 0  # its workspace scored, as a timeout's is
    assert [c.n_output for c in rec.tree.calls] == [len(out), len(out), 1]
    logs = list((tmp_path / "run").rglob("harness.stderr"))
    assert len(logs) == 1 and "token_budget_exhausted" in logs[0].read_text()  # what the harness was told
