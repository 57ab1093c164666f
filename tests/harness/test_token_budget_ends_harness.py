"""proxy.execution_token_budget ends the execution, not only its calls (issue 43).

A harness whose calls are refused for the budget and that keeps calling anyway (retrying, as
agent frameworks do on errors) used to run on until `harness.timeout_s`: minutes to hours of a
harness slot for nothing. Now from its first refused call it has `harness.kill_grace_s` to end by
itself, then it is ended as its time limit would end it (SIGTERM, then SIGKILL), and its workspace
is scored as a timeout's, with the progress it made. A real
harness process, the real proxy (in front of the scripted engine), pool and evaluator."""

from __future__ import annotations

import json
import sys
import time
import warnings

import pytest

from gyre.config import GyreConfig
from gyre.harness.evaluator import EvalOptions, EvaluatorPool
from gyre.harness.runner import HarnessPool, Limits
from gyre.harness.sandbox import Environments, SandboxConfig
from gyre.harness.tasks import BUILTIN_DIR, load_suite
from gyre.services.rollout import RolloutService
from support.proxy_stack import R, Stack

TASK = {t.name: t for t in load_suite(BUILTIN_DIR)}["fizzbuzz"]
TIMEOUT_S = 120.0  # the wall-clock limit: the execution must end long before it

# Half a solution (fizzbuzz right, fizzbuzz_range wrong), then calls forever: a refused call is
# logged and retried, as an agent framework does; it never exits by itself.
AGENT = r'''
import json, os, sys, urllib.error, urllib.request
open("fizzbuzz.py", "w").write(
    "def fizzbuzz(n):\n    if n < 1:\n        raise ValueError(n)\n"
    "    return ('Fizz' if n % 3 == 0 else '') + ('Buzz' if n % 5 == 0 else '') or str(n)\n"
    "def fizzbuzz_range(start, stop):\n    return []\n")
i = 0
while True:
    i += 1
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", method="POST",
        data=json.dumps({"model": "m", "messages": [{"role": "user", "content": "go %d" % i}]}).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
    try:
        urllib.request.urlopen(req, timeout=30).read()
        print("answered", i, file=sys.stderr, flush=True)
    except urllib.error.HTTPError as e:
        print("refused", json.loads(e.read())["error"]["code"], "- retrying", file=sys.stderr, flush=True)
'''


@pytest.fixture
def stack():
    s = Stack()
    yield s
    s.close()


@pytest.mark.slow  # a harness, its grace periods and the task's tests: 2.5-10 s on a loaded machine
def test_a_harness_that_keeps_calling_past_its_budget_is_ended_and_scored_as_a_timeout(stack, tmp_path):
    (tmp_path / "agent.py").write_text(AGENT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        envs = Environments(SandboxConfig(sandbox="none"))  # the host's pids: the test can see them end
    out = R.encode("Hello from the model.") + [R.im_end]
    stack.engine.script = [out]
    stack.proxy.token_budget = 2 * len(out) + 1  # the third call is cut to 1 token, the fourth refused
    service = RolloutService(GyreConfig(), envs, "unused", {"model_hash": "m" * 8, "tokenizer_hash": "t" * 8},
                             tmp_path / "shards")
    service.proxy, service.base_url = stack.proxy, stack.base + "/v1"
    service.pool = HarnessPool(tmp_path / "run", [sys.executable, str(tmp_path / "agent.py")], environments=envs,
                               limits=Limits(timeout_s=TIMEOUT_S, kill_grace_s=0.5))  # its retries spin until then
    service.evaluators = EvaluatorPool(EvalOptions(timeout_s=60, scratch_dir=str(tmp_path / "scratch")), workers=1,
                                       workspaces_root=tmp_path / "run" / "workspaces")
    t0 = time.monotonic()
    try:
        rec = stack.lt.run(service.execute(TASK, "fizzbuzz-g0-a0", 0), timeout=TIMEOUT_S + 60)
    finally:
        service.evaluators.shutdown()
    took = time.monotonic() - t0
    stderr = (tmp_path / "run" / "logs" / "fizzbuzz-g0-a0" / "harness.stderr").read_text()
    # ended by its budget, at once: not by its wall-clock limit, and nothing of it left running
    assert took < TIMEOUT_S / 4, (took, stderr[-2000:])
    assert rec.status == "timeout", (rec.status, rec.error)
    budget = stack.proxy.token_budget
    assert rec.error == f"token budget of {budget} sampled tokens reached (proxy.execution_token_budget)"
    assert service.pool.running == 0 and not service._ending
    assert stderr.count("answered") == 3 and "refused token_budget_exhausted - retrying" in stderr  # told why
    assert [c.n_output for c in rec.tree.calls] == [len(out), len(out), 1]  # refused calls are not recorded
    # scored as a timeout is, with the progress it made: fizzbuzz's tests pass, fizzbuzz_range's do not
    assert rec.reward_source == "tests-after-timeout" and 0 < rec.passed < rec.total, (rec.reward_source, rec.passed)
    assert 0.0 < rec.reward < 1.0


def test_ending_an_execution_that_is_not_running_does_nothing(tmp_path):
    import asyncio

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        envs = Environments(SandboxConfig(sandbox="none"))
    pool = HarnessPool(tmp_path / "run", [sys.executable, "-c", "pass"], environments=envs)
    assert asyncio.run(pool.end_as_timeout("nope", "why")) is False
    res = asyncio.run(pool.run_execution(TASK, "fizzbuzz-g1-a0", api_key="k", base_url="http://127.0.0.1:9/v1"))
    assert res.status == "done" and res.error is None  # an execution nobody ended keeps its own end
    assert json.dumps(res.to_dict())  # still a plain record
