"""xLong at its real length (issue 28): materialization and one training step of the paper's
case-study execution and of the same shape scaled to 0.25M .. 2M processed tokens.

Each point (execution x layout x stage) runs in its own child process, so one point's memory
never shows in another's: the child resets its peak-RSS mark (`/proc/self/clear_refs`, 5) once
the execution is generated (and, for training, the tiny model loaded), and reports the peak
above that baseline (VmHWM - VmRSS before the stage). Writes benchmarks/results/xlong.json:

  tokens_<pt>                  processed tokens of the execution (every tree token once)
  unique_tokens_<pt>           tokens of the K = 5 selected trajectories (tree layout rows)
  longest_trajectory_<pt>
  materialize_s_<layout>_<pt>, materialize_peak_mb_<layout>_<pt>
                               select K = 5, lay out, build every micro-batch (tensors)
  train_step_s_<layout>_<pt>, train_peak_mb_<layout>_<pt>
                               one optimizer step of the tiny model (~/.cache/gyre/tiny-qwen) over
                               those micro-batches: tree attention, train.recompute, chunked
                               log-probs; null where the point (or a shorter one of the same
                               layout) ran past --train-timeout
  peak_mb_growth_exponent_<stage>_<layout>, peak_mb_growth_exponent (the largest)
                               slope of log peak memory against log tokens over the scaled points
  case_study_trains            1 when the case study (tree, K = 5) finished its step: the
                               end-to-end check
  train_step_s_case_study, train_peak_mb_case_study
                               that step (= train_step_s_tree_case, train_peak_mb_tree_case)
  tree_attention_s_old_<f>, tree_attention_s_new_<f>, tree_attention_speedup_<f>
                               the CPU tree attention alone (forward + backward, the tiny model's
                               4 x 16 heads over 2 KV heads, random q/k/v) on the tree row of the
                               case study scaled by f: the version before the flash-kernel path
                               (read from git at OLD_ATTENTION) against the current one, each the
                               best of two alternated runs; speedup = old / new on the same inputs

<pt> is case, 250k, 500k, 1m or 2m. Run by `make bench`, not by `make test`:
    python benchmarks/bench_xlong.py [--points case,250k] [--train-timeout 3600]
                                     [--attention-points x0.05,x0.1]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import xlong_serving  # noqa: E402  (the proxy/shard keys of xlong.json)

OUT = ROOT / "benchmarks" / "results" / "xlong.json"
POINTS = {"case": None, "250k": 250_000, "500k": 500_000, "1m": 1_000_000, "2m": 2_000_000}
LAYOUTS = ("tree", "expanded")
K = 5
CASE_PROCESSED = 566_422  # processed tokens of case_study(seed=0): the scale factor's unit
# the CPU tree attention before the flash-kernel path (SDPA per chunk, backward recomputing it)
OLD_ATTENTION = "3bfd5b7a4d3a073f37b57d2cc625ab1b5979d6ae:gyre/train/tree_attention.py"


def _mem_kb() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM", "VmRSS")):
                out[line.split(":")[0]] = int(line.split()[1])
    return out


def _reset_peak() -> int:
    """Reset this process's peak RSS to its current RSS; returns that RSS in kB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _mem_kb()["VmRSS"]


def _execution(point: str, vocab: int):
    from gyre.traj.synthetic import CASE_STUDY, generate, scaled

    if point.startswith("x"):  # xF: the case study scaled by F (quick checks: --points x0.05,x0.1)
        shape = scaled(CASE_STUDY, float(point[1:]))
    else:
        target = POINTS[point]
        shape = CASE_STUDY if target is None else scaled(CASE_STUDY, target / CASE_PROCESSED)
    rec = generate(shape, execution_id=f"xlong-{point}")
    if vocab:
        for node in rec.tree.nodes:  # the tiny model's vocabulary; the tree keeps its structure
            node.tokens = (node.tokens % (vocab - 1) + 1).astype(node.tokens.dtype)
    return rec


def _budget(step, layout: str) -> int:
    e = step.executions[0]
    longest = max(int(e.arrays.length[e.record.tree.path(leaf)].sum()) for leaf in e.leaves)
    return max(e.n_tokens, longest) if layout == "tree" else longest


def child(point: str, layout: str, stage: str) -> dict:
    import torch

    from gyre.traj.materialize import materialize, prepare_step
    from gyre.traj.select import SelectionSpec
    from gyre.traj.synthetic import processed_tokens

    torch.set_num_threads(2)
    trainer = None
    vocab = 0
    if stage == "train":
        from gyre.config import TrainConfig, default_tiny_dir, load_config
        from gyre.train.trainer import EmbeddedTrainer

        model_dir = default_tiny_dir(load_config(None))
        trainer = EmbeddedTrainer(TrainConfig(dtype="float32", recompute=True, logprob_chunk=1024,
                                              off_policy="none"), str(model_dir), device="cpu")
        vocab = trainer.model.spec.vocab_size
    rec = _execution(point, vocab)
    out = {"tokens": processed_tokens(rec)}
    base = _reset_peak()
    t0 = time.perf_counter()
    # one execution: advantage = its reward (a group of one has no GRPO baseline), so the step
    # has a real gradient
    step = prepare_step([rec], SelectionSpec(k=K), step_version=1, estimator="reward")
    budget = _budget(step, layout)
    mat = materialize(step.executions, layout=layout, micro_batch_tokens=budget)
    if trainer is None:
        for i in range(len(mat)):
            mat[i]  # the tensors of every micro-batch
    else:
        for i in range(len(mat)):
            trainer.forward_backward(mat[i])
        trainer.optimizer_step()
    out["seconds"] = time.perf_counter() - t0
    out["peak_mb"] = (_mem_kb()["VmHWM"] - base) / 1024
    e = step.executions[0]
    out["unique_tokens"] = e.n_tokens
    out["longest_trajectory"] = max(int(e.arrays.length[e.record.tree.path(l)].sum()) for l in e.leaves)
    out["micro_batches"] = len(mat)
    return out


def _old_attention():
    """The tree_attention module at OLD_ATTENTION, or None outside a git checkout holding it."""
    res = subprocess.run(["git", "-C", str(ROOT), "show", OLD_ATTENTION], capture_output=True,
                         text=True, check=False)
    if res.returncode != 0:
        print(f"  tree attention: no {OLD_ATTENTION} in this checkout, old/new not measured", flush=True)
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(res.stdout)
    spec = importlib.util.spec_from_file_location("old_tree_attention", f.name)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    os.unlink(f.name)
    return mod


def attention_speedup(points: list[str]) -> dict:
    """tree_attention_s_{old,new}_<f> and their ratio on the same tree row and inputs."""
    import torch

    from gyre.train import tree_attention
    from gyre.traj.materialize import materialize, prepare_step
    from gyre.traj.select import SelectionSpec

    old = _old_attention()
    if old is None:
        return {}
    torch.set_num_threads(2)
    out = {}
    for pt in points:
        step = prepare_step([_execution(pt, 0)], SelectionSpec(k=K), step_version=1, estimator="reward")
        kv_end = materialize(step.executions, layout="tree", micro_batch_tokens=_budget(step, "tree"))[0].kv_end
        g = torch.Generator().manual_seed(0)
        S = kv_end.shape[1]
        q, k, v = (torch.randn(1, h, S, 16, generator=g, requires_grad=True) for h in (4, 2, 2))
        times = {"old": math.inf, "new": math.inf}
        for _ in range(2):  # alternated, best of two: a busy machine slows one run, not the ratio
            for name, mod in (("old", old), ("new", tree_attention)):
                t0 = time.perf_counter()
                mod.TreeMask.build(kv_end).attend(q, k, v, 0.25).sum().backward()
                times[name] = min(times[name], time.perf_counter() - t0)
                q.grad = k.grad = v.grad = None
        out[f"tree_attention_s_old_{pt}"] = round(times["old"], 3)
        out[f"tree_attention_s_new_{pt}"] = round(times["new"], 3)
        out[f"tree_attention_speedup_{pt}"] = round(times["old"] / times["new"], 2)
        print(f"  tree attention {pt} ({S} tokens): {times}", flush=True)
    return out


def _size(point: str) -> float:
    """Processed tokens a point stands for (runs go shortest first)."""
    if point.startswith("x"):
        return float(point[1:]) * CASE_PROCESSED
    return POINTS[point] or CASE_PROCESSED


def run_point(point: str, layout: str, stage: str, timeout: float) -> dict | None:
    cmd = [sys.executable, __file__, "--child", point, layout, stage]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired:
        print(f"  {stage} {layout} {point}: past {timeout:.0f} s, not measured", flush=True)
        return None
    if res.returncode != 0:
        print(f"  {stage} {layout} {point}: failed\n{res.stderr[-2000:]}", flush=True)
        return None
    return json.loads(res.stdout.strip().splitlines()[-1])


def slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log y against log x (None with fewer than two points)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def main(points: list[str], train_timeout: float, mat_timeout: float, train_layouts: list[str],
         serving: bool = True, attention_points: tuple[str, ...] = ()) -> dict:
    out: dict = {"selection_k": K, "train_timeout_s": train_timeout}
    out.update(attention_speedup(list(attention_points)))
    seen: dict[tuple[str, str], list[tuple[float, float]]] = {}
    too_long: set[str] = set()  # layouts whose training ran past the timeout at a shorter point
    for pt in sorted(points, key=_size):
        for layout in LAYOUTS:
            for stage in ("materialize", "train"):
                if stage == "train" and (layout not in train_layouts or layout in too_long):
                    if layout in too_long:
                        out[f"train_step_s_{layout}_{pt}"] = out[f"train_peak_mb_{layout}_{pt}"] = None
                    continue
                r = run_point(pt, layout, stage, mat_timeout if stage == "materialize" else train_timeout)
                if stage == "train" and r is None:
                    too_long.add(layout)  # a longer execution would not fit the timeout either
                s_key = "materialize_s" if stage == "materialize" else "train_step_s"
                m_key = "materialize_peak_mb" if stage == "materialize" else "train_peak_mb"
                out[f"{s_key}_{layout}_{pt}"] = r and round(r["seconds"], 3)
                out[f"{m_key}_{layout}_{pt}"] = r and round(r["peak_mb"], 1)
                if r:
                    out[f"tokens_{pt}"] = r["tokens"]
                    out[f"unique_tokens_{pt}"] = r["unique_tokens"]
                    out[f"longest_trajectory_{pt}"] = r["longest_trajectory"]
                    if pt != "case":
                        seen.setdefault((stage, layout), []).append((r["tokens"], r["peak_mb"]))
                print(f"  {stage} {layout} {pt}: {r}", flush=True)
    exps = {}
    for (stage, layout), pts in seen.items():
        k = slope([p[0] for p in pts], [p[1] for p in pts])
        if k is not None:
            exps[f"peak_mb_growth_exponent_{stage}_{layout}"] = round(k, 3)
    out.update(exps)
    out["peak_mb_growth_exponent"] = max(exps.values()) if exps else None
    if "case" in points and "tree" in train_layouts:
        out["case_study_trains"] = int(out.get("train_step_s_tree_case") is not None)
        out["train_step_s_case_study"] = out.get("train_step_s_tree_case")
        out["train_peak_mb_case_study"] = out.get("train_peak_mb_tree_case")
    if serving:  # the proxy's per-call cost over a ~1M-token execution, shard write/read (xlong_serving.py)
        out.update(xlong_serving.measure())
    return out


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(*sys.argv[2:5])))
        sys.exit(0)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", default=",".join(POINTS), help=f"comma list of {', '.join(POINTS)}")
    ap.add_argument("--train-timeout", type=float, default=1800.0,
                    help="seconds per training point; a layout past it skips its longer points (null)")
    ap.add_argument("--materialize-timeout", type=float, default=900.0)
    ap.add_argument("--train-layouts", default="tree,expanded")
    ap.add_argument("--no-serving", action="store_true", help="skip the proxy and shard keys (xlong_serving.py)")
    ap.add_argument("--attention-points", default="x0.05,x0.1",
                    help="case-study scales (xF) for the old/new tree attention timing; empty: skip")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args()
    pts = [p for p in a.points.split(",") if p]
    bad = [p for p in pts if p not in POINTS and not p.startswith("x")]
    if bad:
        sys.exit(f"unknown points {bad}: choose from {', '.join(POINTS)}")
    att = [p for p in a.attention_points.split(",") if p]
    if any(not p.startswith("x") for p in att):
        sys.exit(f"--attention-points takes case-study scales like x0.05, got {att}")
    result = main(pts, a.train_timeout, a.materialize_timeout, a.train_layouts.split(","), not a.no_serving, att)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(json.dumps(result, indent=1, sort_keys=True))
