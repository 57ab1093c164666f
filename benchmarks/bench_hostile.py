"""One hostile harness on a shared cluster (issue 24): what it costs the others, and what stops it.

1. **Stop strings** (``stop_dos_*``): HOSTILE streamed calls, each with the most stop text the
   proxy accepts (16 strings, 4,096 characters in all, built so that partial matches never end:
   ``"a" * 255 + "b"``; the output is ``x``s, so every tail check fails, the costliest case for a
   matcher that re-checks the text on each token), run while another execution makes short
   2-token calls one after the other. The figure is that execution's worst call latency while
   the hostile streams run, beside its median alone. The engine is a scripted stand-in (its own
   process, 500 tokens/s per stream, no stop matching of its own) behind the real router and
   proxy, so the cost measured is the proxy's; ``stop_dos_control_*`` is the same load without
   stop strings. The request the issue measured (16 x 10,000 characters) is a 400 now.
2. **Limits** (``limits_enforced``): each default limit, exercised by a real process that passes
   it; listed when it stopped (or capped) the harness with an error naming its key.
3. **Fuzz** (``fuzz_*``): FUZZ seeded mutations of a full request over the schema
   (tests/support/request_fuzz.py) against the proxy; ``fuzz_5xx`` must be 0.
4. **Flood** (``flood_*``, issue 34): one execution keeps FLOOD calls of ``max_tokens`` 1,024 going at
   once (each refused one is sent again 50 ms later) while a sibling makes 2-token calls one after
   the other; ``flood_sibling_p99_ms`` is the sibling's 99th-percentile latency (goal < 500 ms).
   The stand-in engine serves every call at once (it has no admission queue), so the figure is the
   proxy's share; the engine's admission by priority is tests/engine/test_fair_serving.py.
5. **Big body** (``bigbody_*``, issue 34): a 7.5 MB message (under ``proxy.max_body_bytes``) and a
   400,000-character one (under the characters-per-token bound: tokenized, then refused as too
   long) sent again and again by one execution while a sibling makes 2-token calls;
   ``bigbody_refuse_ms`` is the median time to the 7.5 MB message's 400, ``bigbody_sibling_max_ms``
   the sibling's worst latency (goal < 100 ms).
6. **Journal** (``journal_*``, issue 34): the proxy's cost of journaling one call (32K-token input).
7. **Head kill** (``head_kill_*``, issue 34): ``gyre rollout`` SIGKILLed mid-execution, then
   ``--resume``: calls lost per execution, and the resume's time over a run from scratch.
8. **Node** (``forkbomb_*``, ``tmpfs_*``, issue 34): a bash fork bomb ``:(){ :|:& };:`` in the
   default sandbox at the default ``harness.max_processes``, run as an ordinary user (as nobody
   under root: the kernel exempts root from RLIMIT_NPROC): the most processes its tree held at
   once and when it was stopped; and the bytes one harness could write into its in-memory ``/tmp``
   and ``/dev/shm`` together at the default ``harness.tmpfs_mb`` before ENOSPC.

Writes benchmarks/results/hostile.json. ``--only flood,bigbody`` runs those sections and merges
their keys into the file. Takes about two minutes on 2 busy cores.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the scripted engine, the loop thread, the request fuzz

import httpx  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from gyre.engine.router import Router  # noqa: E402
from gyre.proxy.capture import Renderer  # noqa: E402
from gyre.proxy.routes import create_app, start_site  # noqa: E402
from gyre.proxy.server import Proxy  # noqa: E402
from support.loop_thread import LoopThread  # noqa: E402
from support.request_fuzz import cases  # noqa: E402
from support.scripted_engine import ScriptedEngine  # noqa: E402

TOKENIZER = Tokenizer.from_file(str(ROOT / "gyre" / "assets" / "tokenizer.json"))
R = Renderer(TOKENIZER)
HOSTILE = 1  # one hostile harness, as the issue measured
HOSTILE_TOKENS = 1500
TOKEN_DELAY_S = 0.002  # 500 tokens/s per stream from the stand-in engine
VICTIM_CALLS = 60
FUZZ = 2000
FLOOD = 200
SIBLING_CALLS = 60
BIG_BODY_CHARS = 7_500_000
JOURNAL_CONTEXT = 32_768
KILL_AT = 7  # the journaled call at which the head is killed


def serve_engine() -> None:
    """The scripted engine as its own process (``--engine``): calls with stop strings (the hostile
    ones) get a long output of ``a`` tokens, the others a short answer. Prints its port."""
    long_out = R.encode("x" * HOSTILE_TOKENS)[:HOSTILE_TOKENS] + [R.im_end]
    short = R.encode("Hi.") + [R.im_end]
    engine = ScriptedEngine(decode=None)  # no stop matching of its own: the proxy's cost is measured
    engine.script = [short]
    engine.token_delay_s = TOKEN_DELAY_S  # an engine yields between tokens (and serves the others)

    def output(body):
        sp = body.get("sampling_params") or {}
        ids = long_out if (sp.get("max_new_tokens") or 0) > 100 else short  # the hostile ones ask for many
        ids = ids[: sp.get("max_new_tokens") or len(ids)]
        return list(ids), ({"type": "stop", "matched": ids[-1]} if ids[-1] == R.im_end
                           else {"type": "length", "length": len(ids)})
    engine._output = output

    async def main():
        _, port = await start_site(engine.app(), "127.0.0.1", 0)
        print(port, flush=True)
        await asyncio.Event().wait()
    asyncio.run(main())


class Served:
    """Scripted engine in its own process, router + proxy on a loop thread here."""

    def __init__(self, max_body: int = 1 << 20):
        self.eproc = subprocess.Popen([sys.executable, __file__, "--engine"], stdout=subprocess.PIPE, text=True)
        eport = int(self.eproc.stdout.readline())
        self.plt = LoopThread()

        async def prox():
            self.router = Router([f"http://127.0.0.1:{eport}"])
            self.proxy = Proxy(self.router, TOKENIZER)
            return await start_site(create_app(self.proxy, admin_key="admin", max_body_bytes=max_body), "127.0.0.1", 0)

        self.prunner, pport = self.plt.run(prox())
        self.base = f"http://127.0.0.1:{pport}"

    def key(self, eid: str) -> str:
        return self.proxy.register(eid)

    def close(self):
        async def down():
            await self.prunner.cleanup()
            await self.router.close()
        self.plt.run(down())
        self.plt.close()
        self.eproc.terminate()
        self.eproc.wait(10)


def victim_latencies(s: Served, key: str, n: int) -> list[float]:
    out = []
    with httpx.Client(timeout=60) as c:
        for i in range(n):
            t0 = time.perf_counter()
            r = c.post(s.base + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"model": "main", "max_tokens": 2, "messages": [{"role": "user", "content": f"q{i}"}]})
            out.append((time.perf_counter() - t0) * 1e3)
            assert r.status_code == 200, r.text
    return out


def hostile_phase(s: Served, victim: str, stop: list[str] | None) -> tuple[list[float], float]:
    """HOSTILE long streams (with `stop`, or none) while the victim calls; its latencies."""
    def hostile(k: int) -> None:
        body = {"model": "main", "stream": True, "max_tokens": HOSTILE_TOKENS + 1,
                "messages": [{"role": "user", "content": f"x{k}"}]}
        if stop:
            body["stop"] = stop
        with httpx.stream("POST", s.base + "/v1/chat/completions", timeout=300,
                          headers={"Authorization": f"Bearer {s.key(f'hostile-{k}-{time.time_ns()}')}"},
                          json=body) as r:
            for _ in r.iter_lines():
                pass

    threads = [threading.Thread(target=hostile, args=(k,)) for k in range(HOSTILE)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    under = []
    while any(t.is_alive() for t in threads):
        under += victim_latencies(s, victim, 1)
    for t in threads:
        t.join()
    return under, time.perf_counter() - t0


def stop_dos() -> dict:
    s = Served()
    try:
        victim = s.key("victim")
        baseline = victim_latencies(s, victim, VICTIM_CALLS)
        stop = ["a" * 255 + "b"] * 16  # 4,096 characters: the most the proxy accepts
        refused = httpx.post(s.base + "/v1/chat/completions", headers={"Authorization": f"Bearer {s.key('h-big')}"},
                             json={"model": "main", "stream": True, "stop": ["x" * 10_000] * 16,
                                   "messages": [{"role": "user", "content": "x"}]}).status_code
        under, hostile_s = hostile_phase(s, victim, stop)
        control, control_s = hostile_phase(s, victim, None)  # the same streams without stop strings
    finally:
        s.close()
    return {"stop_dos_max_ms": max(under), "stop_dos_p50_ms": statistics.median(under),
            "stop_dos_control_max_ms": max(control), "stop_dos_control_p50_ms": statistics.median(control),
            "stop_dos_baseline_p50_ms": statistics.median(baseline), "stop_dos_baseline_max_ms": max(baseline),
            "stop_dos_victim_calls": len(under), "stop_dos_hostile_streams": HOSTILE,
            "stop_dos_hostile_tokens": HOSTILE_TOKENS, "stop_dos_hostile_s": hostile_s,
            "stop_dos_control_s": control_s, "stop_dos_stop_chars": sum(map(len, stop)),
            "stop_dos_16x10000_status": refused}


def stop_match_cost() -> dict:
    """The proxy's own stop matching per streamed token at the most stop text it accepts, for an
    output that keeps half-matching and one that never matches (deterministic, no servers)."""
    from gyre.proxy.streaming import ContentStream

    out = {}
    for name, ch in (("matching", "a"), ("non_matching", "x")):
        cs, text, worst = ContentStream(["a" * 255 + "b"] * 16, False), "", 0.0
        t0 = time.perf_counter()
        for _ in range(HOSTILE_TOKENS):
            text += ch
            t1 = time.perf_counter()
            cs.delta(text)
            worst = max(worst, time.perf_counter() - t1)
        out[f"stop_match_{name}_worst_token_ms"] = worst * 1e3
        out[f"stop_match_{name}_total_ms"] = (time.perf_counter() - t0) * 1e3
    return out


def fuzz() -> dict:
    s = Served()
    statuses: dict[int, int] = {}
    try:
        key = s.key("fuzz")
        for raw, headers in cases(FUZZ, seed=24):
            req = urllib.request.Request(s.base + "/v1/chat/completions", data=raw, method="POST",
                                         headers={"Content-Type": "application/json",
                                                  "Authorization": f"Bearer {key}", **headers})
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    code = r.status
                    r.read()
            except urllib.error.HTTPError as e:
                code = e.code
            statuses[code] = statuses.get(code, 0) + 1
    finally:
        s.close()
    return {"fuzz_cases": FUZZ, "fuzz_5xx": sum(n for c, n in statuses.items() if c >= 500),
            "fuzz_statuses": {str(k): v for k, v in sorted(statuses.items())}}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _bodies(kind: str) -> list[bytes]:
    if kind == "flood":
        return [json.dumps({"model": "main", "max_tokens": 1024, "messages": [{"role": "user", "content": "go"}]}).encode()]
    return [json.dumps({"model": "main", "messages": [{"role": "user", "content": "x " * (BIG_BODY_CHARS // 2)}]}).encode(),
            json.dumps({"model": "main", "messages": [{"role": "user", "content": "the " * 100_000}]}).encode()]


def attacker(base: str, key: str, kind: str, n: int, retry_s: float = 0.05) -> None:
    """``--attack``: n loops, each sending its body again and again (a refused one 50 ms later)
    until stdin closes; then prints the status counts and the answers' median ms. Its own
    process, so the attacker's client work does not share the proxy's interpreter."""
    import asyncio as aio

    bodies, statuses, ms = _bodies(kind), {}, []
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()

    async def loop_one(c, i):
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                r = await c.post(base + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                 content=bodies[min(i, len(bodies) - 1)])
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                ms.append((time.perf_counter() - t0) * 1e3)
                if r.status_code != 200:
                    await aio.sleep(retry_s)
            except httpx.HTTPError:
                statuses["error"] = statuses.get("error", 0) + 1

    async def main():
        limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
        async with httpx.AsyncClient(timeout=120, limits=limits) as c:
            print("ready", flush=True)
            await aio.gather(*(loop_one(c, i) for i in range(n)))

    aio.run(main())
    print(json.dumps({"statuses": {str(k): v for k, v in sorted(statuses.items(), key=str)},
                      "p50_ms": statistics.median(ms) if ms else None}), flush=True)


def _attack(s: Served, key: str, kind: str, n: int) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, __file__, "--attack", s.base, key, kind, str(n)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def _stop(p: subprocess.Popen) -> dict:
    out, _ = p.communicate("", timeout=300)
    return json.loads(out.strip().splitlines()[-1])


def flood() -> dict:
    s = Served()
    try:
        victim, hostile = s.key("sibling"), s.key("flood")
        p = _attack(s, hostile, "flood", FLOOD)
        time.sleep(1.0)  # the flood is under way before the sibling starts (a load phase, not an outcome)
        lat = victim_latencies(s, victim, SIBLING_CALLS)
        att = _stop(p)
    finally:
        s.close()
    return {"flood_sibling_p99_ms": _pct(lat, 0.99), "flood_sibling_p50_ms": statistics.median(lat),
            "flood_hostile_calls": FLOOD, "flood_hostile_statuses": att["statuses"]}


def bigbody() -> dict:
    s = Served(max_body=8 << 20)
    try:
        victim, hostile = s.key("sibling"), s.key("bigbody")
        huge = _bodies("bigbody")[0]
        refuse = []
        with httpx.Client(timeout=120) as c:
            for _ in range(5):
                t0 = time.perf_counter()
                try:
                    r = c.post(s.base + "/v1/chat/completions", headers={"Authorization": f"Bearer {hostile}"},
                               content=huge)
                    assert r.status_code == 400, r.text[:300]
                finally:  # a proxy that tokenizes it all may not answer in 120 s: that time is the figure
                    refuse.append((time.perf_counter() - t0) * 1e3)
        victim_latencies(s, victim, 5)  # warm
        p = _attack(s, hostile, "bigbody", 2)
        time.sleep(0.5)  # both big bodies on their way before the sibling starts (a load phase)
        lat = victim_latencies(s, victim, SIBLING_CALLS)
        att = _stop(p)
    finally:
        s.close()
    return {"bigbody_refuse_ms": statistics.median(refuse), "bigbody_sibling_max_ms": max(lat),
            "bigbody_sibling_p50_ms": statistics.median(lat), "bigbody_body_bytes": len(huge),
            "bigbody_hostile_statuses": att["statuses"], "bigbody_hostile_p50_ms": att["p50_ms"]}


def journal() -> dict:
    """``journal_overhead_ms_p50``: what journaling one call costs the proxy (its input key over
    the wire text, one JSON line, one write; the fsync is batched off the path), for a call of
    JOURNAL_CONTEXT input and 256 output tokens."""
    from gyre.proxy.capture import WireIds
    from gyre.proxy.journal import Journal

    ids = list(range(JOURNAL_CONTEXT))
    wire = WireIds(json.dumps(ids)[1:-1], len(ids), lambda: ids)
    out, lps = list(range(256)), [-0.5] * 256
    ms = []
    with tempfile.TemporaryDirectory() as tmp:
        j = Journal(tmp)
        for k in range(200):
            t0 = time.perf_counter()
            j.append(f"e{k % 8}", wire, out, lps, "stop", "3")
            ms.append((time.perf_counter() - t0) * 1e3)
        j.close()
    return {"journal_overhead_ms_p50": statistics.median(ms), "journal_overhead_ms_p99": _pct(ms, 0.99),
            "journal_context_tokens": JOURNAL_CONTEXT}


def head_kill() -> dict:
    """``gyre rollout`` (the reference agent, 2 executions of fizzbuzz) SIGKILLed when its
    KILL_AT-th call is journaled (gyre.faults ``proxy:call_journaled``), then ``--resume``:
    ``head_kill_calls_lost_per_execution`` is the most journaled calls of an execution that were
    not answered again from its journal (each harness makes one call at a time, so the call in
    flight at the kill, journaled before its answer, is the most it can lose);
    ``head_kill_resume_over_restart`` is the resume's wall time over a fresh run's."""
    from gyre.proxy.journal import read_journal
    from gyre.proxy.replay import replayed_calls
    from gyre.traj.store import iter_executions

    agent = ["{python}", "-m", "gyre.harness.reference_agent", "--max-tokens", "32", "--max-turns", "6"]
    cmd = "[" + ", ".join(f'"{c}"' for c in agent) + "]"
    with tempfile.TemporaryDirectory() as tmp:
        def run(name, *extra, fault=None):
            env = {**os.environ, **({"GYRE_FAULT": fault, "GYRE_FAULT_DIR": f"{tmp}/faults"} if fault else {})}
            args = [sys.executable, "-m", "gyre.cli", "rollout", "--no-progress", f"run.dir={tmp}/{name}",
                    "engine.endpoints=1", "harness.group_size=2", "harness.concurrency=2", 'harness.tasks=["fizzbuzz"]',
                    f"harness.command={cmd}", *extra]
            t0 = time.perf_counter()
            p = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
            return p, time.perf_counter() - t0

        _, fresh_s = run("fresh")
        first, _ = run("killed", fault=f"proxy:call_journaled:{KILL_AT}")
        assert first.returncode < 0, first.stderr[-2000:]
        journaled = {f.stem.rsplit("-a", 1)[0]: len(read_journal(f)) for f in Path(f"{tmp}/killed/journal").glob("*.jsonl")}
        again, resume_s = run("killed", "--resume", fault=f"proxy:call_journaled:{KILL_AT}")
        assert again.returncode == 0, again.stderr[-2000:]
        replayed = {r.execution_id.rsplit("-a", 1)[0]: replayed_calls(r.tree)
                    for r in iter_executions(f"{tmp}/killed/shards")}
    return {"head_kill_calls_lost_per_execution": max(n - replayed.get(b, 0) for b, n in journaled.items()),
            "head_kill_journaled_calls": sum(journaled.values()), "head_kill_replayed_calls": sum(replayed.values()),
            "head_kill_resume_over_restart": resume_s / fresh_s, "head_kill_fresh_s": fresh_s,
            "head_kill_resume_s": resume_s}


def limits() -> dict:
    import warnings

    from gyre.harness.evaluator import EvalOptions, evaluate_workspace
    from gyre.harness.runner import HarnessPool, Limits
    from gyre.harness.sandbox import Environments, SandboxConfig
    from gyre.harness.tasks import load_suite

    task = {t.name: t for t in load_suite("builtin")}["fizzbuzz"]
    py = sys.executable
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        envs = Environments(SandboxConfig())  # bubblewrap where installed, else bare (as the default)
    scenarios = {
        "harness.max_processes": (dict(max_processes=20),
                                  "import subprocess, time\nps = [subprocess.Popen(['sleep', '30']) for _ in range(40)]\n"
                                  "time.sleep(30)\n"),
        "harness.max_memory_mb": (dict(max_memory_mb=150),
                                  "import os, time\nfor _ in range(3):\n    if os.fork() == 0: break\n"
                                  "b = bytearray(60 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\ntime.sleep(30)\n"),
        "harness.max_workspace_mb": (dict(max_workspace_mb=8),
                                     "import time\nfor i in range(12): open(f'f{i}', 'wb').write(b'x' * (1 << 20))\n"
                                     "time.sleep(30)\n"),
        "harness.max_log_mb": (dict(max_log_mb=1),
                               "import sys\nfor _ in range(64): sys.stdout.write('o' * 65536)\n"),
    }
    enforced, detail = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for key, (kw, script) in scenarios.items():
            pool = HarnessPool(Path(tmp) / key, [py, "-c", script], environments=envs,
                               limits=Limits(timeout_s=60, kill_grace_s=0.5, poll_s=0.1, **kw))
            t0 = time.perf_counter()
            res = asyncio.run(pool.run_execution(task, "e1", api_key="k", base_url="http://127.0.0.1:9/v1"))
            dt = time.perf_counter() - t0
            if key == "harness.max_log_mb":
                kept = (Path(res.log_dir) / "harness.stdout").stat().st_size
                ok = res.status == "done" and kept < (1 << 20) + 200
            else:
                ok = res.status == "failed" and key in (res.error or "")
            detail[key] = {"status": res.status, "error": res.error, "s": round(dt, 2)}
            if ok:
                enforced.append(key)
        ws = Path(tmp) / "sparse-ws"
        ws.mkdir()
        with open(ws / "blob", "wb") as f:
            f.truncate(4 << 30)
            f.write(b"x" * 4096)
        (ws / "big").write_bytes(os.urandom(3 << 20))
        ev = evaluate_workspace(task, ws, "done", EvalOptions(timeout_s=60, scratch_dir=str(Path(tmp) / "scratch"),
                                                              max_copy_mb=2, environments=envs))
        if ev.source == "eval-error" and "eval.max_copy_mb" in (ev.error or ""):
            enforced.append("eval.max_copy_mb")
        detail["eval.max_copy_mb"] = {"source": ev.source, "error": ev.error}
    return {"limits_enforced": enforced, "limits_detail": detail, "limits_sandbox": envs.host_backend}


def node() -> dict:
    from gyre.config import HarnessConfig
    from gyre.harness.limits import kernel_counts_per_namespace, kernel_process_cap
    from gyre.harness.runner import HarnessPool, Limits
    from gyre.harness.sandbox import Environments, SandboxConfig
    from gyre.harness.tasks import load_suite
    from support.node_limits import FILL, fork_bomb

    h = HarnessConfig()
    out = {"forkbomb_max_processes": h.max_processes,
           "forkbomb_kernel_cap": kernel_process_cap(h.max_processes) if kernel_counts_per_namespace() else None}
    with tempfile.TemporaryDirectory(prefix="gyre-forkbomb-") as tmp:
        bomb = fork_bomb(Path(tmp), h.max_processes, nproc_net=3 * h.max_processes + 1000)
    out.update(forkbomb_peak_processes=bomb.get("peak_processes"), forkbomb_stopped_after_s=bomb.get("stopped_after_s"),
               forkbomb_error=bomb.get("error") or bomb.get("skipped"))
    task = {t.name: t for t in load_suite("builtin")}["fizzbuzz"]
    with tempfile.TemporaryDirectory() as tmp:
        pool = HarnessPool(Path(tmp) / "run", [sys.executable, "-c", FILL, "/tmp", "/dev/shm"],
                           limits=Limits(timeout_s=120, kill_grace_s=0.5),
                           extra_env={"GYRE_FILL_MB": str(4 * h.tmpfs_mb)},
                           environments=Environments(SandboxConfig(sandbox="bwrap", tmpfs_mb=h.tmpfs_mb)))
        res = asyncio.run(pool.run_execution(task, "fill", api_key="k", base_url="http://127.0.0.1:9/v1"))
        got = json.loads((Path(res.workspace) / "fill.json").read_text())
    out.update(tmpfs_mb=h.tmpfs_mb, tmpfs_bytes_allowed=sum(n for n, _ in got.values()),
               tmpfs_errors=sorted({e for _, e in got.values() if e}))
    return out


SECTIONS = {"stop_dos": stop_dos, "stop_match": stop_match_cost, "fuzz": fuzz, "limits": limits,
            "flood": flood, "bigbody": bigbody, "journal": journal, "head_kill": head_kill, "node": node}


def main(only: list[str] | None = None) -> dict:
    res = {}
    for name in only or SECTIONS:
        res.update(SECTIONS[name]())
    return {**res, "load_avg_1m": os.getloadavg()[0]}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--engine"]:
        serve_engine()
        sys.exit(0)
    if sys.argv[1:2] == ["--attack"]:
        attacker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
        sys.exit(0)
    only = sys.argv[2].split(",") if sys.argv[1:2] == ["--only"] else None
    res = main(only)
    out = ROOT / "benchmarks" / "results" / "hostile.json"
    if only and out.exists():  # the other sections' figures stay
        res = {**json.loads(out.read_text()), **res}
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
