"""`gyre export RUN_DIR [--step N] OUT`: a run's trained model as a transformers directory.

The weights of step N come from the engines' export of that step (``weights/v<N>``, already in
transformers layout) when it is still on disk, else from the trainer checkpoint of that step
(``checkpoints/v<N>``: the run's trainer backend is built on the run's model and loads it), and at
step 0 from the model itself. The directory written beside them holds what a loader needs and an
engine export lacks: the tokenizer, the chat template and the generation config of the run's model
(`gyre.train.export.write_model_dir`). Without ``--step`` the run's last committed step
(``state.json``) is exported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from gyre.config import ConfigError, GyreConfig, default_tiny_dir, initial_model, load_config, trainer_config
from gyre.position import Position

CONFIG_FILE = "config.toml"   # gyre/report/config_file.py writes it at a run's start
STATE_FILE = "state.json"     # gyre/services/ledger.py: the last committed step


class ExportError(Exception):
    """The run directory or the step asked for cannot be exported (the message says why)."""


@dataclasses.dataclass(frozen=True)
class RunFiles:
    """Where one run keeps its model, engine exports and checkpoints (as `gyre run` put them)."""
    cfg: GyreConfig
    model_dir: Path
    weights_root: Path
    ckpt_root: Path
    committed: int      # the last committed step (state.json), 0 before the first

    @classmethod
    def of(cls, run_dir: str | Path) -> "RunFiles":
        run_dir = Path(run_dir)
        if not (run_dir / CONFIG_FILE).exists():
            raise ExportError(f"{run_dir} is not a run directory (no {CONFIG_FILE}); pass the run.dir of a `gyre run`")
        cfg = load_config(run_dir / CONFIG_FILE)
        state = run_dir / STATE_FILE
        committed = int(json.loads(state.read_text())["version"]) if state.exists() else 0
        return cls(cfg, Path(initial_model(cfg) or default_tiny_dir(cfg)),
                   Path(cfg.train.export_dir or run_dir / "weights"),
                   Path(cfg.train.checkpoint_dir or run_dir / "checkpoints"), committed)

    def steps_on_disk(self) -> list[int]:
        """Whole steps whose weights can still be had (engine export or checkpoint), ascending."""
        found = {0}
        for root in (self.weights_root, self.ckpt_root):
            for d in root.glob("v*") if root.is_dir() else ():
                at = Position.of_name(d.name)
                if at is not None and at.boundary and d.is_dir():
                    found.add(at.step)
        return sorted(found)


def step_weights(run: RunFiles, step: int):
    """(config, HF-named state dict) of the policy after ``step`` optimizer steps."""
    from gyre.train.export import load_hf_dir

    at = Position(step)
    exported = run.weights_root / str(at)
    if step == 0 or (exported / "config.json").exists():
        src = run.model_dir if step == 0 else exported
        _, state = load_hf_dir(src)
        return json.loads((src / "config.json").read_text(encoding="utf-8")), state
    ckpt = run.ckpt_root / str(at)
    if ckpt.is_dir():
        return _from_checkpoint(run, ckpt)
    raise ExportError(f"step {step} is no longer on disk (neither {exported} nor {ckpt}); steps that are: "
                      f"{', '.join(map(str, run.steps_on_disk()))}")


def _from_checkpoint(run: RunFiles, ckpt: Path):
    from gyre.train.backends import make_trainer
    from gyre.train.export import config_dict

    # one process: a checkpoint saved at any parallel layout loads into tensor/pipeline/expert 1
    cfg = dataclasses.replace(trainer_config(run.cfg), tensor_parallel=1, pipeline_parallel=1, expert_parallel=1,
                              context_parallel=1, dtype="float32")
    trainer = make_trainer(cfg, run.model_dir, seed=run.cfg.run.seed)
    trainer.load_checkpoint(ckpt)
    return config_dict(trainer.hf_config), trainer.hf_state_dict()


def export_run(run_dir: str | Path, out: str | Path, step: int | None = None) -> Path:
    """Write step ``step`` (default: the last committed) of the run in ``run_dir`` to ``out``."""
    from gyre.train.export import write_model_dir

    run = RunFiles.of(run_dir)
    step = run.committed if step is None else step
    if step < 0:
        raise ExportError(f"--step {step}: a step is a whole number >= 0")
    if step > run.committed:
        raise ExportError(f"--step {step}: the run committed {run.committed} steps; pass --step {run.committed} or less")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out} exists and is not empty; pass a new directory")
    hf_config, state = step_weights(run, step)
    ckpt = run.ckpt_root / str(Position(step))
    source = {"run": str(Path(run_dir).resolve()), "step": step,
              "checkpoint": str(ckpt.resolve()) if ckpt.is_dir() else None}  # model.init_optimizer = "carried" reads it
    return write_model_dir(out, state, hf_config, run.model_dir, step, source=source)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path, help="the run directory (run.dir of a `gyre run`)")
    p.add_argument("out", type=Path, help="the transformers model directory to write (new or empty)")
    p.add_argument("--step", type=int, default=None, help="the step to export (default: the last committed)")


def run(args: argparse.Namespace) -> int:
    try:
        path = export_run(args.run_dir, args.out, args.step)
    except (ExportError, ConfigError, FileNotFoundError) as e:
        print(f"gyre export: {e}", file=sys.stderr)
        return 2
    print(f"gyre export: {path} (load with transformers.AutoModelForCausalLM.from_pretrained or "
          f"`gyre engine --model {path}`)")
    return 0
