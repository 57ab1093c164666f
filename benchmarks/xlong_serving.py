"""xLong serving costs: the proxy's own time per call along a ~1M-token execution, and shard
write/read time and peak memory for executions of 0.25M to 2M tokens (issue 28, item 5).

Proxy: one execution of CALLS sequential agent calls (assistant tool call + tool result per turn,
tool outputs sized so the execution processes ~PROXY_TOKENS prompt + output tokens in all) sent
over loopback HTTP to the REAL proxy, router and engine client. The engine is the scripted engine
of tests/ (tests/support/scripted_engine.py: SGLang's /generate over HTTP, answers a chosen tool call at
once, no model), so the figure is the proxy's own work. The per-call time is the proxy's own
measure (handler time minus the time on the wire to the engine, ``Proxy.overhead_s``); the
execution is run PROXY_REPEATS times and each call's minimum kept (the machine is shared: load
spikes are not the proxy's). ``proxy_call_ms_first``/``_last`` are the p50 of the first and last
PROXY_WINDOW calls. The proxy prepares a request on a worker thread (gyre.proxy.offload) when what it
may tokenize holds over INLINE_CHARS characters: counted over the messages the execution's last
call did not send, this execution's calls all stay under it (before, its late calls went over), and
the ``*_inline`` keys repeat each figure with every request prepared inline whatever its size. Run for
the built-in ChatML renderer (no suffix) and for the model-template path in both history modes
(``_exact``, ``_template``; template: tests/templates/chatml_hermes.jinja).

Shards: synthetic executions of the paper's case-study shape (gyre.traj.synthetic.CASE_STUDY)
with every message length scaled so the tree holds ~N unique tokens (``_scaled_case_study``, a
local helper: synthetic.py has no scaling of its own yet). Write = ShardWriter.write (pack +
durable shard), read = read_shard with checksums. Peak memory: tracemalloc's peak above the
records already in memory (numpy registers its buffers with tracemalloc), in a second pass so
the timed pass runs untraced.

Engine: the embedded engine's model (the tiny model's long variant, `gyre make-model
--max-positions 262144`) runs one 512-token prompt chunk and one decode step after a 256K-token
KV cache (made up: a real 256K prefill of even the tiny model takes hours on CPU). In a child
process, so its peak RSS is its own: ``engine_chunk_peak_mb_256k`` is the peak above the process
with the cache in place, i.e. what the chunk itself holds (the KV cache: ``engine_kv_mb_256k``).

``measure()`` returns the flat dict; ``python benchmarks/xlong_serving.py`` writes
benchmarks/results/xlong_serving.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
import urllib.request
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from tokenizers import Tokenizer  # noqa: E402

from gyre.engine.router import Router  # noqa: E402
from gyre.model.chat_template import ChatTemplate  # noqa: E402
from gyre.proxy.capture import Renderer  # noqa: E402
from gyre.proxy.routes import create_app, start_site  # noqa: E402
from gyre.proxy.server import Proxy  # noqa: E402
from gyre.traj.store import ShardWriter, read_shard  # noqa: E402
from gyre.traj.synthetic import CASE_STUDY, Lengths, case_study, generate  # noqa: E402
from support.loop_thread import LoopThread  # noqa: E402
from support.scripted_engine import ScriptedEngine  # noqa: E402

PROXY_TOKENS = 1_000_000
CALLS = 100
PROXY_WINDOW = 20
PROXY_REPEATS = 9  # each call's minimum over the repeats: 3 left the ratios +-0.2 on a shared machine
SHARD_SIZES = {"0.25M": 250_000, "0.5M": 500_000, "1M": 1_000_000, "2M": 2_000_000}
TOKENIZER = ROOT / "gyre" / "assets" / "tokenizer.json"
TEMPLATE = ROOT / "tests" / "templates" / "chatml_hermes.jinja"
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a shell command",
                                           "parameters": {"type": "object",
                                                          "properties": {"command": {"type": "string"}}}}}]
WORDS = ("def", "return", "self", "import", "numpy", "tokens", "proxy", "tree", "shard", "None", "for", "in",
         "range", "if", "else", "class", "path", "=", "(", ")", ":", "0", "1", "42", "test_", "assert", "x", "y")
SYSTEM = "You are a coding agent working in a repository. Use the bash tool to inspect and edit files."
TASK = "Implement the missing functions of the package so that the tests pass.\n" + "Spec: " + " ".join(WORDS) * 20


def _text(rng: np.random.Generator, n_words: int) -> str:
    words = rng.choice(WORDS, n_words)
    lines = [" ".join(words[i:i + 12]) for i in range(0, n_words, 12)]
    return "\n".join(lines)


def _post(url: str, body: dict, key: str) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def proxy_run(mode: str, calls: int = CALLS, target_tokens: int = PROXY_TOKENS, inline: bool = False) -> dict:
    """One execution through the proxy; ``mode``: builtin, exact or template; ``inline``: every
    request prepared on the event loop. Returns the proxy's own time per call (s, in call order)
    and the tokens the execution processed."""
    import gyre.proxy.server as server

    saved = server.INLINE_CHARS
    server.INLINE_CHARS = 1 << 62 if inline else saved
    try:
        return _proxy_run(mode, calls, target_tokens)
    finally:
        server.INLINE_CHARS = saved


def _proxy_run(mode: str, calls: int, target_tokens: int) -> dict:
    tok = Tokenizer.from_file(str(TOKENIZER))
    r = Renderer(tok)
    rng = np.random.default_rng(0)
    # tool output per turn so that sum over calls of (context) ~ target: context_i ~ base + i * g
    chars_per_token = len(_text(rng, 2000)) / len(r.encode_text(_text(rng, 2000)))
    base = len(r.encode_text(SYSTEM + TASK)) + 400
    grow = max(1.0, 2 * (target_tokens - calls * base) / calls ** 2)
    words = max(1, int((grow - 40) * chars_per_token / 5.3))  # ~5.3 chars per word with its space
    lt = LoopThread()
    engine = ScriptedEngine(decode=r.decode, context_length=1 << 22)
    engine.script = [r.encode('<tool_call>\n{"name": "bash", "arguments": {"command": "cat src/mod_%d.py"}}\n'
                              '</tool_call>' % i) + [r.im_end] for i in range(calls)]
    kw = {} if mode == "builtin" else {"chat_template": ChatTemplate(TEMPLATE.read_text()), "history": mode}
    box: dict = {}

    async def up():
        box["erunner"], eport = await start_site(engine.app(), "127.0.0.1", 0)
        box["router"] = Router([f"http://127.0.0.1:{eport}"])
        box["proxy"] = Proxy(box["router"], tok, max_tokens_cap=64, **kw)
        app = create_app(box["proxy"], admin_key="bench-admin", max_body_bytes=64 << 20)
        box["prunner"], box["port"] = await start_site(app, "127.0.0.1", 0)

    async def down():
        await box["prunner"].cleanup()
        await box["router"].close()
        await box["erunner"].cleanup()

    lt.run(up())
    try:
        proxy = box["proxy"]
        key = proxy.register("xlong", task="t")
        url = f"http://127.0.0.1:{box['port']}/v1/chat/completions"
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
        processed = 0
        for i in range(calls):
            resp = _post(url, {"model": "main", "messages": messages, "tools": TOOLS, "max_tokens": 64}, key)
            processed += resp["usage"]["total_tokens"]
            msg = resp["choices"][0]["message"]
            calls_made = msg.get("tool_calls") or []
            if not calls_made:
                raise RuntimeError(f"call {i}: the scripted tool call did not parse: {msg}")
            messages.append({"role": "assistant", "content": msg.get("content"), "tool_calls": calls_made})
            messages.append({"role": "tool", "tool_call_id": calls_made[0]["id"], "content": _text(rng, words)})
        overhead = list(proxy.overhead_s)
        reused = resp["gyre"]["reused_messages"]
    finally:
        lt.run(down())
        lt.close()
    return {"overhead_s": overhead, "processed": processed, "reused_last": reused,
            "context_last": resp["usage"]["prompt_tokens"]}


def _p50_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def _scaled_case_study(unique_tokens: int, seed: int = 0):
    """The case-study shape with every message length scaled so its tree holds ~unique_tokens."""
    base = case_study(seed).tree.stats().unique_tokens
    f = unique_tokens / base

    def scale(lengths: Lengths) -> Lengths:
        return replace(lengths, median=lengths.median * f, hi=int(lengths.hi * max(1.0, f)))

    shape = replace(CASE_STUDY, seed=seed, system=scale(CASE_STUDY.system), task=scale(CASE_STUDY.task),
                    assistant=scale(CASE_STUDY.assistant), tool=scale(CASE_STUDY.tool),
                    summary=scale(CASE_STUDY.summary))
    return generate(shape, execution_id=f"xlong-{unique_tokens}")


IDENTITY = {"model": "bench-model", "tokenizer": "bench-tokenizer"}


def shard_run(record, work: Path) -> dict:
    w = ShardWriter(work, identity=IDENTITY)
    t = time.perf_counter()
    path = w.write([record])
    write_s = time.perf_counter() - t
    t = time.perf_counter()
    back = read_shard(path)
    read_s = time.perf_counter() - t
    assert len(back[0].tree.nodes) == len(record.tree.nodes)
    del back
    path.unlink()
    tracemalloc.start()
    path = w.write([record])
    write_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.reset_peak()
    back = read_shard(path)
    read_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del back
    path.unlink()
    return {"write_s": write_s, "read_s": read_s, "write_peak_mb": write_peak / 2 ** 20,
            "read_peak_mb": read_peak / 2 ** 20}


ENGINE_CONTEXT = 262_144


def engine_probe() -> dict:
    """(child process) One prompt chunk and one decode step after a made-up 256K-token cache."""
    import torch

    from gyre.engine.qwen import CausalLM, KVCache
    from gyre.model.tiny import LONG_POSITIONS, ensure_tiny_model

    with tempfile.TemporaryDirectory(prefix="gyre-xlong-model-") as tmp:
        model = CausalLM.from_dir(ensure_tiny_model(Path(tmp) / "tiny-long", max_positions=LONG_POSITIONS))
    past = ENGINE_CONTEXT - 512 - 1
    cache = KVCache(model.spec, capacity=ENGINE_CONTEXT)
    for t in cache.k + cache.v:
        t.normal_()
    cache.length = past
    ids = torch.randint(0, 2000, (512,)).tolist()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    model.forward(ids, cache)
    chunk_s = time.perf_counter() - t
    t = time.perf_counter()
    model.decode([ids[0]], [cache])
    decode_s = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"engine_context_256k": cache.length, "engine_kv_mb_256k": cache.nbytes() / 2 ** 20,
            "engine_chunk_s_256k": chunk_s, "engine_decode_s_256k": decode_s,
            "engine_chunk_peak_mb_256k": (peak - base) / 1024}


def measure() -> dict[str, float]:
    out: dict[str, float] = {"proxy_calls": CALLS, "proxy_window": PROXY_WINDOW}
    child = subprocess.run([sys.executable, __file__, "--engine-probe"], capture_output=True, text=True,
                           check=True, timeout=1800)
    out.update(json.loads(child.stdout.strip().splitlines()[-1]))
    for (mode, suffix), inline in itertools.product(
            (("builtin", ""), ("exact", "_exact"), ("template", "_template")), (False, True)):
        suffix += "_inline" if inline else ""
        runs = [proxy_run(mode, inline=inline) for _ in range(PROXY_REPEATS)]
        o = [min(r["overhead_s"][i] for r in runs) for i in range(CALLS)]
        run = runs[0]
        out[f"proxy_call_ms_first{suffix}"] = _p50_ms(o[:PROXY_WINDOW])
        out[f"proxy_call_ms_last{suffix}"] = _p50_ms(o[-PROXY_WINDOW:])
        out[f"proxy_last_over_first{suffix}"] = out[f"proxy_call_ms_last{suffix}"] / out[f"proxy_call_ms_first{suffix}"]
        out[f"proxy_tokens_processed{suffix}"] = run["processed"]
        out[f"proxy_context_last{suffix}"] = run["context_last"]
    with tempfile.TemporaryDirectory(prefix="gyre-xlong-serving-") as tmp:
        for name, n in SHARD_SIZES.items():
            record = _scaled_case_study(n)
            out[f"shard_tokens_{name}"] = record.tree.stats().unique_tokens
            figures = shard_run(record, Path(tmp))
            for k, v in figures.items():
                out[f"shard_{k}_{name}"] = v
            del record
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}


if __name__ == "__main__":
    if "--engine-probe" in sys.argv:
        print(json.dumps(engine_probe()))
        sys.exit(0)
    # bench_xlong.py merges these keys into xlong.json; run alone, this prints them, and with
    # `--update benchmarks/results/xlong.json` re-measures just them there (the training points
    # of bench_xlong.py take hours on 2 cores; these, minutes)
    ap = argparse.ArgumentParser(description="the xlong serving keys (proxy cost over a long execution)")
    ap.add_argument("--update", type=Path, metavar="XLONG_JSON",
                    help="merge the measured keys into this results file (benchmarks/results/xlong.json)")
    path = ap.parse_args().update
    if path is not None and not path.is_file():  # checked before minutes of measuring
        ap.error(f"--update {path}: no such results file (bench_xlong.py writes it)")
    figures = measure()
    for k, v in figures.items():
        print(f"{k:>34}: {v}")
    if path is not None:
        merged = {**json.loads(path.read_text()), **figures}
        path.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
        print(f"updated {len(figures)} keys in {path}")
