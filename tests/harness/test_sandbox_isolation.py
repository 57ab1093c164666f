"""A hostile harness under the default configuration: every attempt on its siblings, the job's
secrets and the hidden tests fails, and its own calls still work.

Real pieces throughout: the proxy (per-execution keys, call capture) in front of a scripted engine
on loopback, the harness pool with its default sandbox (bubblewrap), a live sibling execution, an
engine key in a private file and in a process's environment, as `gyre rollout` keeps them.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
from tokenizers import Tokenizer

import gyre
from gyre.harness.runner import HarnessPool
from gyre.harness.sandbox import Environments, SandboxConfig, UnsandboxedWarning
from gyre.harness.tasks import BUILTIN_DIR, load_suite

from support.scripted_engine import ScriptedEngine

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

TASKS = {t.name: t for t in load_suite("builtin")}
TOKENIZER = Tokenizer.from_file(str(Path(gyre.__file__).parent / "assets" / "tokenizer.json"))

# The sibling: records one call, leaves a secret in its workspace, says it is ready (a file the
# test sees), and stays alive until the test tells it to stop.
VICTIM = r'''
import json, os, time, urllib.request
W = os.environ["GYRE_WORKSPACE"]
open(W + "/victim-secret.txt", "w").write("VICTIM-SECRET-" + os.environ["GYRE_EXECUTION_ID"])
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
    data=json.dumps({"model": "main", "messages": [{"role": "user", "content": "victim"}], "max_tokens": 4}).encode(),
    headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
urllib.request.urlopen(req, timeout=30).read()
open(W + "/ready", "w").write("1")
deadline = time.time() + 120
while not os.path.exists(W + "/stop") and time.time() < deadline:
    time.sleep(0.05)
'''

# The attacker: it is told where everything lives on the host (as an insider would know the layout).
HOSTILE = r'''
import glob, hashlib, json, os, re, socket, sys, urllib.error, urllib.request
T = json.loads(os.environ["HOSTILE_TARGETS"])
W = os.environ["GYRE_WORKSPACE"]
report = {"read": [], "listed": [], "wrote": [], "keys_found": [], "engine_key_found": False,
          "hidden_tests_found": [], "engine_reachable": False, "forged_ok": [], "own_call": None, "pids": []}

def is_engine_key(blob):  # it is told only the key's hash (its own environment must not hold the key)
    return any(hashlib.sha256(m).hexdigest() == T["engine_key_sha"] for m in re.findall(rb"ENGINE-[0-9a-f]{32}", blob))

def try_read(p):
    try:
        with open(p, "rb") as f:
            data = f.read(1 << 20)
        report["read"].append(p)
        return data
    except OSError:
        return None

# 1. sibling workspaces and the run directory, by host path and by walking up
for d in (T["run_dir"], T["run_dir"] + "/workspaces", T["victim_ws"], W + "/..", W + "/../victim"):
    try:
        report["listed"].append([d.replace(W, "OWN"), os.listdir(d)])
    except OSError:
        pass
try_read(T["victim_ws"] + "/victim-secret.txt")
try:
    with open(T["victim_ws"] + "/planted.txt", "w") as f:
        f.write("x")
    report["wrote"].append("victim_ws")
except OSError:
    pass
# 2. every process's environment and command line: API keys, the engine key
blobs = []
for pid in os.listdir("/proc"):
    if pid.isdigit():
        report["pids"].append(int(pid))
        for part in ("environ", "cmdline"):
            b = try_read("/proc/%s/%s" % (pid, part))
            if b:
                blobs.append(b)
for b in blobs:
    for item in b.split(b"\0"):
        if item.startswith(b"OPENAI_API_KEY=") and item[15:].decode() != os.environ["OPENAI_API_KEY"]:
            report["keys_found"].append(item[15:].decode())
        if is_engine_key(item):
            report["engine_key_found"] = True
for p in glob.glob("/tmp/gyre-engine-key-*") + glob.glob(T["host_tmp"] + "/gyre-engine-key-*") + [T["engine_key_file"]]:
    b = try_read(p)
    if b and is_engine_key(b):
        report["engine_key_found"] = True
# 3. the hidden tests: in the installed package, by import, and anywhere on the visible file system
for p in glob.glob(T["gyre_pkg"] + "/harness/builtin/*/tests/*.py"):
    if try_read(p) is not None:
        report["hidden_tests_found"].append(p)
try:
    import gyre.harness.tasks
    report["hidden_tests_found"].append("import gyre.harness.tasks")
except Exception:
    pass
import subprocess
expr = []
for n in T["hidden_names"]:
    expr += ["-o", "-name", n]
found = subprocess.run(["find", "/", "(", "-path", "/proc", "-o", "-path", "/sys", "-o", "-path", "/dev", ")",
                        "-prune", "-o", "(", *expr[1:], ")", "-print"], capture_output=True, text=True).stdout
for p in found.split():  # same name is not enough (networkx has a test_matrix.py): same content
    b = try_read(p)
    if b is not None and hashlib.sha256(b).hexdigest() in T["hidden_sha"]:
        report["hidden_tests_found"].append(p)
# 4. the network: the engine directly, the proxy's host address directly
for port in (T["engine_port"],):
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect(("127.0.0.1", port))
        report["engine_reachable"] = True
    except OSError:
        pass
    s.close()
# 5. forged calls into the sibling's tree with every key found, then its own call
def call(key, text):
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": "main", "messages": [{"role": "user", "content": text}], "max_tokens": 4}).encode(),
        headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
    try:
        return urllib.request.urlopen(req, timeout=30).status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError as e:
        return str(e)
for k in report["keys_found"]:
    if call(k, "forged") == 200:
        report["forged_ok"].append(k)
report["own_call"] = call(os.environ["OPENAI_API_KEY"], "hostile")
open(W + "/report.json", "w").write(json.dumps(report))
'''


@pytest.mark.slow
def test_hostile_harness_fails_every_attempt_and_keeps_its_own_calls(tmp_path):
    from gyre.engine.router import Router
    from gyre.proxy.capture import Renderer
    from gyre.proxy.routes import create_app, start_site
    from gyre.proxy.server import Proxy

    engine_key = "ENGINE-" + secrets.token_hex(16)
    fd, key_file = tempfile.mkstemp(prefix="gyre-engine-key-")  # as start_engine keeps it
    os.write(fd, engine_key.encode())
    os.close(fd)
    # a host process holding the engine key in its environment (the engine's own process)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                              env={"GYRE_ENGINE_KEY": engine_key, "PATH": os.defpath})
    engine = ScriptedEngine()
    engine.script = [Renderer(TOKENIZER).encode("ok") + [Renderer(TOKENIZER).im_end]]
    run_dir = tmp_path / "run"
    hidden = sorted({p.name for p in Path(BUILTIN_DIR).glob("*/tests/*.py")})

    async def scenario():
        erunner, eport = await start_site(engine.app(), "127.0.0.1", 0)
        router = Router([f"http://127.0.0.1:{eport}"])
        proxy = Proxy(router, TOKENIZER)
        prunner, pport = await start_site(create_app(proxy, admin_key="admin"), "127.0.0.1", 0)
        base = f"http://127.0.0.1:{pport}/v1"
        try:
            victim_pool = HarnessPool(run_dir, ["{python}", "-c", VICTIM])  # the default configuration
            hostile_pool = HarnessPool(run_dir, ["{python}", "-c", HOSTILE])
            assert victim_pool.envs.host_backend == "bwrap"
            vkey = proxy.register("victim", task="fizzbuzz")
            hkey = proxy.register("hostile", task="fizzbuzz")
            victim = asyncio.create_task(victim_pool.run_execution(TASKS["fizzbuzz"], "victim", api_key=vkey, base_url=base))
            vws = run_dir / "workspaces" / "victim"
            while not (vws / "ready").exists():  # wait on the sibling's state, not on time
                assert not victim.done(), victim.result()
                await asyncio.sleep(0.05)
            targets = {"run_dir": str(run_dir), "victim_ws": str(vws),
                       "engine_key_sha": hashlib.sha256(engine_key.encode()).hexdigest(),
                       "engine_key_file": key_file, "host_tmp": tempfile.gettempdir(),
                       "gyre_pkg": str(Path(gyre.__file__).parent), "hidden_names": hidden, "engine_port": eport,
                       "hidden_sha": sorted(hashlib.sha256(p.read_bytes()).hexdigest()
                                            for p in Path(BUILTIN_DIR).glob("*/tests/*.py"))}
            hres = await hostile_pool.run_execution(TASKS["fizzbuzz"], "hostile", api_key=hkey, base_url=base,
                                                    extra_env={"HOSTILE_TARGETS": json.dumps(targets)})
            (vws / "stop").write_text("1")
            vres = await victim
            return hres, vres, proxy.end("victim"), proxy.end("hostile"), vkey
        finally:
            await prunner.cleanup()
            await router.close()
            await erunner.cleanup()

    try:
        hres, vres, vrec, hrec, vkey = asyncio.run(scenario())
    finally:
        holder.kill()
        holder.wait()
        os.unlink(key_file)
    assert hres.status == "done", (Path(hres.log_dir) / "harness.stderr").read_text()
    assert vres.status == "done", (Path(vres.log_dir) / "harness.stderr").read_text()
    report = json.loads((Path(hres.workspace) / "report.json").read_text())
    # its own call went through the proxy and was recorded in its own tree
    assert report["own_call"] == 200 and len(hrec.tree.calls) == 1
    # nothing of the sibling: not its workspace, its key, nor its tree
    # (its own root, "/workspace/..", lists; nothing of the run directory or the sibling does)
    assert [d for d, _ in report["listed"]] == ["OWN/.."] and report["wrote"] == []
    assert "victim" not in json.dumps(report["listed"]) and "workspaces" not in json.dumps(report["listed"])
    assert not any("victim" in p for p in report["read"])
    assert report["keys_found"] == [] and report["forged_ok"] == []
    assert len(vrec.tree.calls) == 1 and not (Path(vres.workspace) / "planted.txt").exists()
    # only its own sandbox's processes (bubblewrap's init, the launcher, the harness)
    assert len(report["pids"]) <= 4, report["pids"]
    # not the engine key, not the hidden tests, not the engine's port
    assert report["engine_key_found"] is False
    assert report["hidden_tests_found"] == []
    assert report["engine_reachable"] is False
    # and none of it leaked into anything the hostile harness left behind
    leaked = [vkey, engine_key, "VICTIM-SECRET"]
    for p in [*Path(hres.workspace).rglob("*"), *Path(hres.log_dir).rglob("*")]:
        if p.is_file():
            data = p.read_bytes()
            assert not any(s.encode() in data for s in leaked), p


def test_sandbox_none_is_an_explicit_opt_out_that_warns():
    with pytest.warns(UnsandboxedWarning, match="WITHOUT a sandbox"):
        envs = Environments(SandboxConfig(sandbox="none"))
    assert envs.host_backend == "none" and envs.place(TASKS["fizzbuzz"]).kind == "host"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Environments(SandboxConfig()).host_backend == "bwrap"  # the default: no warning


def test_sandbox_bwrap_without_bwrap_is_a_clear_error(monkeypatch):
    from gyre.config import ConfigError
    from gyre.harness.runtimes.bwrap import Bwrap

    monkeypatch.setattr(Bwrap, "missing", lambda self: "bwrap is not installed (not on PATH)")
    with pytest.raises(ConfigError, match="harness.sandbox = bwrap but bwrap is not installed.*apt-get install bubblewrap"):
        Environments(SandboxConfig(sandbox="bwrap"))
    with pytest.warns(UnsandboxedWarning, match="bubblewrap .* is not installed"):
        Environments(SandboxConfig(sandbox="auto"))
