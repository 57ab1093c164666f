"""Checkpoints and exports (issue 44): bounded disk over a run, and `gyre export` fidelity.

  * ``export_bytes_per_step``: bytes of one engine export (``weights/v<N>``) of the tiny qwen2;
  * ``exports_kept_max``, ``checkpoints_kept_max``, ``disk_bytes_max`` / ``disk_bytes_unbounded``:
    20 steps of real exports and checkpoints (steps_per_sync = 2, run.checkpoint_every = 5,
    run.keep_checkpoints = 2, run.keep_best = 1) under gyre/services/retention.py, against keeping all;
  * ``export_logprob_max_abs_diff`` (and per family): `gyre export` of a trained step loaded by
    transformers' AutoModelForCausalLM (its own forward) vs the trainer's log-probs, for qwen2,
    qwen3_moe, qwen3_5 and qwen3_next;
  * ``layouts_round_tripped``: Megatron checkpoints of a tiny MoE saved at one layout, loaded at
    another and stepped once, equal (max abs diff of every weight < 1e-6, in
    ``layout_max_abs_diff_<from>_to_<to>``) to the run that never stopped: expert parallel 2 over
    gloo <-> one process. Tensor and pipeline parallelism are not run by Gyre's Megatron backend.
Writes benchmarks/results/checkpoints.json. About a minute on 2 cores.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

from gyre.config import GyreConfig, TrainConfig  # noqa: E402
from gyre.position import Position  # noqa: E402
from gyre.services.retention import Retention, dir_bytes, positions  # noqa: E402
from gyre.train.export import export_pieces  # noqa: E402

STEPS = 20
FAMILIES = ("qwen2", "qwen3_moe", "qwen3_5", "qwen3_next")


def disk(root: Path) -> dict:
    from gyre.train.backends import make_trainer
    from gyre.model.tiny import ensure_tiny_model

    trainer = make_trainer(TrainConfig(dtype="float32"), ensure_tiny_model(root / "model"))
    cfg = GyreConfig()
    cfg.run.checkpoint_every, cfg.run.keep_checkpoints, cfg.run.keep_best, cfg.run.best_metric = 5, 2, 1, "val"
    run = root / "run"
    ret = Retention.from_config(cfg, run / "weights", run / "checkpoints")
    used, exports, ckpts = [], [], []
    for v in range(1, STEPS + 1):
        export_pieces(trainer.hf_state_dict(), trainer.hf_config, run / "weights" / str(Position(v)), v)
        trainer.save_checkpoint(run / "checkpoints" / str(Position(v)))
        ret.record({"version": v, "val": 1.0 if v == 7 else 0.0})
        ret.after_commit(v, v - 1 if v % 2 else v)
        used.append(dir_bytes(run))
        exports.append(len(positions(run / "weights")))
        ckpts.append(len(positions(run / "checkpoints")))
    export = dir_bytes(run / "weights" / str(Position(STEPS)))
    ckpt = dir_bytes(run / "checkpoints" / str(Position(STEPS)))
    return {"export_bytes_per_step": export, "checkpoint_bytes_per_step": ckpt, "exports_kept_max": max(exports),
            "checkpoints_kept_max": max(ckpts), "disk_bytes_max": max(used),
            "disk_bytes_unbounded": STEPS * (export + ckpt)}


def export_fidelity(root: Path) -> dict:
    from support.export_run import batch, hf_logprobs, make_run  # the test's run and transformers oracle

    from gyre.model.tiny import ensure_tiny_model
    from gyre.train.export_cli import export_run

    out = {}
    for family in FAMILIES:
        base = root / family
        base.mkdir()
        run, trainer = make_run(base, family, ensure_tiny_model(base / "model", family))
        export_run(run, base / "out")
        out[f"export_logprob_max_abs_diff_{family}"] = float((hf_logprobs(base / "out") - trainer.logprobs(batch()))
                                                            .abs().max())
    out["export_logprob_max_abs_diff"] = max(out.values())
    return out


def layouts(root: Path) -> dict:
    import functools

    from support.gloo_ranks import spawned_ranks
    from support.megatron_checkpoint import _ep2_rank, one_process
    from support.megatron_moe import _model
    from gyre.model.spec import split_fused_experts

    hf = _model()
    hf_state = {k: v.numpy().copy() for k, v in split_fused_experts(hf.state_dict()).items()}
    out, done = {}, []
    [(_, ep2)] = spawned_ranks(functools.partial(_ep2_rank, root / "ep2", False), hf.config, hf_state, replies=1)
    _, one = one_process(hf, hf_state, ckpt=root / "ep2")
    out["layout_max_abs_diff_ep2_to_ep1"] = max(float((one[k] - torch.as_tensor(ep2[k])).abs().max()) for k in one)
    _, one = one_process(hf, hf_state, save=root / "ep1")
    [(_, ep2)] = spawned_ranks(functools.partial(_ep2_rank, root / "ep1", True), hf.config, hf_state, replies=1)
    out["layout_max_abs_diff_ep1_to_ep2"] = max(float((one[k] - torch.as_tensor(ep2[k])).abs().max()) for k in one)
    for name in ("ep2_to_ep1", "ep1_to_ep2"):
        if out[f"layout_max_abs_diff_{name}"] < 1e-6:
            done.append(name.replace("_to_", "->"))
    return out | {"layouts_round_tripped": done}


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        res = disk(Path(tmp) / "disk")
        res |= export_fidelity(Path(tmp))
        res |= layouts(Path(tmp))
    path = ROOT / "benchmarks" / "results" / "checkpoints.json"
    path.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
