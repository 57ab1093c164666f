"""Your reward: a Python function (``reward.function = "module:function"``) or a reward server
(``reward.url``) scores an execution instead of the tests' pass share.

It gets what the evaluator saw: the retained workspace (its path), the task (name, prompt, test
commands and count, the dataset row's metadata), the test results (the evaluator's reward,
passed/total and source; ``None`` where the task has no tests) and the execution's calls (per call:
agent role, input and output token counts, finish reason, policy version, sampling parameters).

    def score(workspace: str, task: dict, tests: dict | None, calls: list[dict]) -> float | dict

A float is the reward. A dict is a set of named parts, logged one by one: the reward is the part
named ``reward`` where there is one, else the sum of the parts. Anything else (an exception, a
non-finite number, a time limit passed, a server's error) is a *failed evaluation* with its
reason (source ``reward-error``, reward None: never trained, never a silent 0).

Why a subprocess in a sandbox: the function is the user's code, it reads what the policy wrote (and
may import it), and the head must outlive it. It runs in a fresh interpreter
(``python reward_child.py``, which imports nothing of Gyre) inside the harness's sandbox
(gyre.harness.sandbox: bubblewrap on the host root, ``harness.sandbox``), with the same limits as
an evaluation: the workspace read-only at ``/workspace`` (``workspace`` says that path), the
folders of ``reward.pythonpath`` read-only at their own paths (the run directory and the gyre
package hidden where they lie inside one), the tests' log read-only, a private ``/tmp`` and
``/dev/shm`` of ``harness.tmpfs_mb``, the kernel's process cap of ``harness.max_processes``, no
network, and nothing else of the host (not the run directory, other workspaces, keys or hidden
tests). The request comes on stdin and the answer on stdout: no host folder is writable inside.
Around it, rlimits (address space ``reward.memory_mb``, a CPU-time cap, the size of what it
prints) and a wall-clock limit (``reward.timeout_s``) after which its whole process group is
killed. A write outside, a read of what it may not see, is an exception in the function: a
``reward-error`` like any other. Under ``harness.sandbox = none`` it runs bare (warned once at
start). The server alternative is one aiohttp POST of the same JSON with the same time limit.

Each call is appended to ``<run.dir>/rewards.jsonl`` (execution, reward, parts, error, seconds, and
``sandbox``: where it ran, bwrap, none or server): the parts of every execution are on disk, and
`calls`/`errors` count them for reports.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from gyre.config import ConfigError
from gyre.harness import proc
from gyre.harness.runtimes import Mount
from gyre.harness.sandbox import WORKSPACE, Environments, SandboxConfig, host_python, run_steps

REWARD_LOG = "rewards.jsonl"
CHILD = Path(__file__).with_name("reward_child.py")  # run by path: the child imports nothing of Gyre
CHILD_INSIDE = "/gyre-reward-child.py"  # the gyre package is hidden in the sandbox: the child is bound alone
TESTS_LOG_INSIDE = "/gyre-tests.log"
OUTPUT_MB = 16  # what the reward process may print (its answer and its stderr), a file each


class RewardError(Exception):
    """What the reward gave back is not a reward; the message says what and how to fix it."""


@dataclass
class RewardResult:
    reward: float | None            # None: the reward failed (see error)
    parts: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    seconds: float = 0.0


def interpret(value) -> tuple[float, dict[str, float]]:
    """(reward, parts) of what a reward function or server returned; RewardError if neither a
    finite number nor a non-empty {name: finite number}."""
    if isinstance(value, bool):
        raise RewardError(f"returned a bool ({value}); return a float or a dict of named floats")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise RewardError(f"returned {value}: a reward must be finite")
        return float(value), {}
    if isinstance(value, dict) and value:
        parts = {}
        for k, v in value.items():
            if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise RewardError(f"part {k!r} = {v!r}: every part must be a name with a finite number")
            parts[k] = float(v)
        total = parts["reward"] if "reward" in parts else sum(parts.values())
        return total, parts
    raise RewardError(f"returned {type(value).__name__} {str(value)[:80]!r}; return a float or a non-empty dict "
                      "of named floats")


def call_summary(call) -> dict:
    """What a reward sees of one recorded call (gyre.traj.tree.CallRecord)."""
    return {k: getattr(call, k, None) for k in ("index", "agent_role", "n_input", "n_output", "finish_reason",
                                                 "policy_version", "temperature", "top_p", "t_start", "t_end")}


def task_summary(task) -> dict:
    return {"name": task.name, "prompt": task.prompt, "test_commands": list(task.test_commands),
            "test_case_count": task.test_case_count, "metadata": dict(getattr(task, "metadata", None) or {})}


def tests_summary(ev) -> dict | None:
    """The tests' results, or None where the task has none to run."""
    if ev is None or (ev.source == "unscorable" and not ev.total):
        return None
    return {"reward": ev.reward, "passed": ev.passed, "total": ev.total, "source": ev.source, "error": ev.error,
            "log_path": ev.log_path}


class RewardFn:
    """One configured reward (function or URL); thread-safe (evaluations run in worker threads)."""

    def __init__(self, function: str = "", url: str = "", pythonpath=(), timeout_s: float = 60.0,
                 memory_mb: int = 2048, cpu_s: int = 0, log_path: str | os.PathLike | None = None,
                 pass_env=("PATH", "HOME", "LANG"), sandbox: SandboxConfig | None = None,
                 environments: Environments | None = None, max_processes: int = 0):
        """``sandbox``/``environments``: the harness's (default: bubblewrap where it exists);
        ``max_processes``: the kernel's process cap inside, as ``harness.max_processes``."""
        if bool(function) == bool(url):
            raise ValueError("a RewardFn needs exactly one of function and url")
        self.function, self.url = function, url
        self.pythonpath = [str(Path(p).absolute()) for p in pythonpath]
        self.timeout_s, self.memory_mb = timeout_s, memory_mb
        self.cpu_s = cpu_s or int(math.ceil(timeout_s)) + 5
        self.log_path = Path(log_path) if log_path else None
        self.pass_env = tuple(pass_env)
        self.sandbox, self.environments, self.max_processes = sandbox or SandboxConfig(), environments, max_processes
        self.calls = 0
        self.errors = 0
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, cfg, environments: Environments | None = None) -> "RewardFn | None":
        r = cfg.reward
        if not (r.function or r.url):
            return None
        for folder in r.pythonpath if r.function else ():  # said at start, not once per execution
            if not Path(folder).is_dir():
                raise ConfigError(f"reward.pythonpath: {folder} is not a folder here ({os.uname().nodename}, "
                                  f"relative paths are from {os.getcwd()}); name the folder holding the module")
        return cls(r.function, r.url, r.pythonpath, r.timeout_s, r.memory_mb,
                   log_path=Path(cfg.run.dir) / REWARD_LOG, pass_env=tuple(cfg.harness.pass_env),
                   sandbox=SandboxConfig.from_config(cfg.harness), environments=environments,
                   max_processes=cfg.harness.max_processes)

    def envs(self) -> Environments:
        with self._lock:
            if self.environments is None:
                self.environments = Environments(self.sandbox)
            return self.environments

    @property
    def label(self) -> str:
        return self.function or self.url

    def __call__(self, payload: dict, execution_id: str = "") -> RewardResult:
        t0 = time.monotonic()
        try:
            raw = self._remote(payload) if self.url else self._subprocess(payload)
            reward, parts = interpret(raw)
            res = RewardResult(reward, parts, None, time.monotonic() - t0)
        except RewardError as e:
            res = RewardResult(None, {}, f"reward {self.label}: {e}", time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - the user's reward failing is this execution's error
            res = RewardResult(None, {}, f"reward {self.label}: {type(e).__name__}: {e}", time.monotonic() - t0)
        self._note(execution_id, res)
        return res

    def _note(self, execution_id: str, res: RewardResult) -> None:
        with self._lock:
            self.calls += 1
            self.errors += res.error is not None
            if self.log_path is not None:
                where = "server" if self.url else self.environments.host_backend if self.environments else None
                line = {"execution": execution_id, "reward": res.reward, "parts": res.parts, "error": res.error,
                        "seconds": round(res.seconds, 4), "t": time.time(), "sandbox": where}
                self.log_path.parent.mkdir(parents=True, exist_ok=True)
                with open(self.log_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(line) + "\n")

    # ---- a function, in its own interpreter, in the harness's sandbox -------------------------------
    def _subprocess(self, payload: dict):
        missing = [p for p in self.pythonpath if not os.path.isdir(p)]
        if missing:
            raise RewardError(f"reward.pythonpath: {missing[0]} is not a folder on this node ({os.uname().nodename})")
        envs = self.envs()
        place = envs.host_place()
        env = proc.child_env(self.pass_env, {"PYTHONPATH": os.pathsep.join(self.pythonpath),
                                             "PYTHONDONTWRITEBYTECODE": "1"})
        teardown: list = []
        if place.kind == "host":  # harness.sandbox = none: bare, as the user asked (warned at start)
            argv = [sys.executable, str(CHILD)]
        else:
            argv, env, payload, teardown = self._sandboxed(envs, place, env, payload)
        with tempfile.TemporaryDirectory(prefix="gyre-reward-") as tmp:
            inp, out, log = Path(tmp) / "in.json", Path(tmp) / "stdout", Path(tmp) / "stderr"
            inp.write_text(json.dumps({"function": self.function, "payload": payload}), encoding="utf-8")
            argv = proc.with_limits(argv, cpu_s=self.cpu_s, memory_mb=self.memory_mb, fsize_mb=OUTPUT_MB)
            try:
                with open(inp, "rb") as fin, open(out, "wb") as fout, open(log, "wb") as err:
                    child = subprocess.Popen(argv, cwd=tmp, env=env, stdin=fin, stdout=fout, stderr=err,
                                             start_new_session=True)
                    try:
                        rc = child.wait(timeout=self.timeout_s)
                    except subprocess.TimeoutExpired:
                        proc.kill_group(child.pid, signal.SIGKILL)
                        child.wait()
                        raise RewardError(f"took longer than reward.timeout_s = {self.timeout_s:g} s "
                                          "(killed)") from None
                    finally:
                        proc.kill_group(child.pid, signal.SIGKILL)
            finally:
                run_steps(teardown, env, check=False)
            text = out.read_text(encoding="utf-8", errors="replace")
            if rc != 0 or not text:
                tail = log.read_bytes()[-600:].decode("utf-8", "replace").strip().splitlines()
                why = tail[-1] if tail else f"exit status {rc}"
                raise RewardError(f"the reward process failed (exit {rc}): {why}")
            return json.loads(text)["value"]

    def _sandboxed(self, envs: Environments, place, env: dict, payload: dict):
        """argv, environment, the payload as seen inside, and tear-down steps of one sandboxed call."""
        envs.warn_unbounded(place, self.max_processes)
        for k in ("PATH", "HOME", "TMPDIR", "SHELL"):
            env.pop(k, None)  # host paths mean nothing inside (the instance sets PATH to its python's)
        env["HOME"] = "/tmp"
        mounts = [Mount(str(CHILD.resolve()), CHILD_INSIDE)]
        payload = dict(payload)
        if payload.get("workspace"):
            mounts.append(Mount(str(Path(payload["workspace"]).resolve()), WORKSPACE))
            payload["workspace"] = WORKSPACE
        tests = payload.get("tests")
        if isinstance(tests, dict) and tests.get("log_path") and os.path.isfile(tests["log_path"]):
            mounts.append(Mount(str(Path(tests["log_path"]).resolve()), TESTS_LOG_INSIDE))
            payload["tests"] = {**tests, "log_path": TESTS_LOG_INSIDE}
        folders = [str(Path(p).resolve()) for p in self.pythonpath]
        mounts += [Mount(p, p) for p in dict.fromkeys(folders)]
        argv = envs.launcher(place, self.max_processes) + ["--", host_python(), CHILD_INSIDE]
        private = [Path(self.log_path).parent] if self.log_path is not None else []
        inst = envs.instance(place, argv, mounts, env, name=f"reward-{os.getpid()}", private=private,
                             workdir="/tmp", max_processes=self.max_processes)
        inst.masks = sorted({*inst.masks, *_hidden_inside(folders, private)})
        la = envs.launch(place, inst)
        run_steps(la.setup, la.env, check=True)
        return la.argv, la.env, payload, la.teardown

    # ---- a server --------------------------------------------------------------------------------
    def _remote(self, payload: dict):
        return asyncio.run(post_reward(self.url, payload, self.timeout_s))


def _hidden_inside(folders: list[str], private: list[Path]) -> list[str]:
    """The run directory and the gyre package (its suites' hidden tests) where they lie inside a
    folder of reward.pythonpath: masked, so that naming the repository there does not show them."""
    import gyre  # the package folder itself

    hidden = [Path(gyre.__file__).resolve().parent, *[p.resolve() for p in private]]
    return [str(h) for h in hidden if any(h != Path(f) and h.is_relative_to(f) for f in folders)]


async def post_reward(url: str, payload: dict, timeout_s: float):
    """POST the payload as JSON; the answer is a number, or an object (its ``reward``/parts)."""
    import aiohttp

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
            async with s.post(url, json=payload) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise RewardError(f"server answered {resp.status}: {text[:200]}")
    except asyncio.TimeoutError:
        raise RewardError(f"server took longer than reward.timeout_s = {timeout_s:g} s") from None
    except aiohttp.ClientError as e:
        raise RewardError(f"server unreachable: {type(e).__name__}: {e}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise RewardError(f"server answered non-JSON: {text[:200]!r}") from None

