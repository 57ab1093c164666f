"""Checkpoints and exports (issue 44): bounded disk over a run, and `gyre export` fidelity.

  * ``export_bytes_per_step``: bytes of one engine export (``weights/v<N>``) of the tiny qwen2;
  * ``exports_kept_max``, ``checkpoints_kept_max``, ``disk_bytes_max`` / ``disk_bytes_unbounded``:
    20 steps of real exports and checkpoints (steps_per_sync = 2, run.checkpoint_every = 5,
    run.keep_checkpoints = 2, run.keep_best = 1) under gyre/services/retention.py, against keeping all;
  * ``export_logprob_max_abs_diff`` (and per family): `gyre export` of a trained step loaded by
    transformers' AutoModelForCausalLM (its own forward) vs the trainer's log-probs, for qwen2,
    qwen3_moe, qwen3_5 and qwen3_next;
  * ``layouts_round_tripped``: the layouts a Megatron checkpoint went from and to with every weight
    and Adam moment equal (max abs diff < 1e-6, in ``layout_max_abs_diff_<from>_to_<to>``), gloo
    ranks on the CPU: a tiny MoE at expert parallel 2 <-> one process (each side stepping), the
    tiny qwen2 at tensor parallel 2 <-> one process (each side stepping; a TP 2 step against a
    one-process step differs by rounding, ~1e-8) and pipeline parallel 2 <-> one process (PP 2
    saves and loads but does not train: no pipeline schedule), and the tiny MoE at tensor 2 x
    pipeline 2 x expert 2 (eight ranks) <-> one process.
Writes benchmarks/results/checkpoints.json. A few minutes on 2 cores (the eight ranks ~1.5 min);
``--layouts`` runs only the layouts and updates their keys in the existing file.
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


def _diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), "the two states hold different parameters"
    return max(float((torch.as_tensor(a[k]) - torch.as_tensor(b[k])).abs().max()) for k in a)


def _saved_diff(a: Path, b: Path) -> float:
    from support.megatron_layouts import saved

    sa, sb = saved(a), saved(b)
    return max(_diff(sa[k], sb[k]) for k in ("model", "exp_avg", "exp_avg_sq"))


def _stepped(trainer, times: int = 1):
    from support.megatron_layouts import batch

    for _ in range(times):
        trainer.forward_backward(batch())
        trainer.optimizer_step()
    return trainer


def expert_layouts(root: Path) -> dict:
    """EP 2 <-> one process, each side stepping (tests/train/test_checkpoint_megatron.py)."""
    import functools

    from support.gloo_ranks import spawned_ranks
    from support.megatron_checkpoint import _ep2_rank, one_process
    from support.megatron_moe import _model
    from gyre.model.spec import split_fused_experts

    hf = _model()
    hf_state = {k: v.numpy().copy() for k, v in split_fused_experts(hf.state_dict()).items()}
    out = {}
    [(_, ep2)] = spawned_ranks(functools.partial(_ep2_rank, root / "ep2", False), hf.config, hf_state, replies=1)
    _, one = one_process(hf, hf_state, ckpt=root / "ep2")
    out["ep2->ep1"] = _diff(one, ep2)
    _, one = one_process(hf, hf_state, save=root / "ep1")
    [(_, ep2)] = spawned_ranks(functools.partial(_ep2_rank, root / "ep1", True), hf.config, hf_state, replies=1)
    out["ep1->ep2"] = _diff(one, ep2)
    return out


def tensor_pipeline_layouts(root: Path) -> dict:
    """The tiny qwen2 at TP 2 (which trains) and PP 2 (which saves and loads only: no pipeline
    schedule), and the tiny MoE at TP 2 x PP 2 x EP 2 (eight ranks) from and back to one process
    (tests/train/test_megatron_layouts.py)."""
    import functools

    from support import megatron_layouts as L
    from support.gloo_ranks import spawned_ranks
    from support.megatron_moe import _model
    from gyre.model.spec import split_fused_experts

    def ranks(layout, hf, hf_state, load, save, step):
        [reply] = spawned_ranks(functools.partial(L.layout_rank, layout, load, save, step), hf.config, hf_state,
                                replies=1, world=L.world(layout), timeout_s=600)
        return reply

    hf, hf_state = L.model()
    out = {}
    # TP 2 saves after a step; one process loads it and steps, against one process stepping twice
    ranks({"tensor_parallel": 2}, hf, hf_state, None, root / "tp2", True)
    loaded = L.trainer(hf.config, hf_state)
    loaded.load_checkpoint(root / "tp2")
    one = _stepped(L.trainer(hf.config, hf_state), 2)
    out["tp2->tp1"] = _diff(one.hf_state_dict(), _stepped(loaded).hf_state_dict())
    # one process saves after a step; TP 2 loads it and steps
    _stepped(L.trainer(hf.config, hf_state)).save_checkpoint(root / "tp1")
    _, tp2, _, _, _ = ranks({"tensor_parallel": 2}, hf, hf_state, root / "tp1", None, True)
    out["tp1->tp2"] = _diff(one.hf_state_dict(), tp2)
    # PP 2 loads the one-process checkpoint and saves it again; one process loads that and steps
    _, pp2, _, _, _ = ranks({"pipeline_parallel": 2}, hf, hf_state, root / "tp1", root / "pp2", False)
    out["pp1->pp2"] = max(_saved_diff(root / "tp1", root / "pp2"),
                          _diff(_stepped(L.trainer(hf.config, hf_state)).hf_state_dict(), pp2))
    back = L.trainer(hf.config, hf_state)
    back.load_checkpoint(root / "pp2")
    out["pp2->pp1"] = _diff(one.hf_state_dict(), _stepped(back).hf_state_dict())
    # the MoE at TP 2 x PP 2 x EP 2
    moe = _model()
    moe_state = {k: v.numpy().copy() for k, v in split_fused_experts(moe.state_dict()).items()}
    first = _stepped(L.trainer(moe.config, moe_state))
    first.save_checkpoint(root / "moe1")
    three = {"tensor_parallel": 2, "pipeline_parallel": 2, "expert_parallel": 2}
    _, whole, _, _, _ = ranks(three, moe, moe_state, root / "moe1", root / "moe3", False)
    out["tp1->tp2.pp2.ep2"] = max(_saved_diff(root / "moe1", root / "moe3"), _diff(first.hf_state_dict(), whole))
    back = L.trainer(moe.config, moe_state)
    back.load_checkpoint(root / "moe3")
    out["tp2.pp2.ep2->tp1"] = _diff(_stepped(first).hf_state_dict(), _stepped(back).hf_state_dict())
    return out


def layouts(root: Path) -> dict:
    diffs = expert_layouts(root) | tensor_pipeline_layouts(root)
    out = {f"layout_max_abs_diff_{k.replace('->', '_to_').replace('.', '_')}": v for k, v in diffs.items()}
    return out | {"layouts_round_tripped": [k for k, v in diffs.items() if v < 1e-6]}


def main() -> int:
    path = ROOT / "benchmarks" / "results" / "checkpoints.json"
    with tempfile.TemporaryDirectory() as tmp:
        if "--layouts" in sys.argv[1:]:
            res = {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith(("layout_", "layouts_"))}
        else:
            res = disk(Path(tmp) / "disk")
            res |= export_fidelity(Path(tmp))
        res |= layouts(Path(tmp))
    path.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
