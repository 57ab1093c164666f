"""One metrics sink fed by the run's events: metrics.jsonl always, TensorBoard and W&B when installed.

The figures are the ones `gyre.events.RunStats` computed (the step row the head also writes to
steps.jsonl, and each cell's time so far), flattened into `group/name` scalars, so the same
keys appear in metrics.jsonl, in TensorBoard and in W&B. `run.loggers` picks the backends; one
whose library is not installed is skipped and named in `skipped` (the report says so). W&B runs
offline unless `run.wandb_mode` says otherwise (`wandb sync <run.dir>/wandb/offline-run-*` uploads).
We use the libraries' own writers (torch.utils.tensorboard, wandb) rather than writing their
formats ourselves.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import asdict
from pathlib import Path

from gyre.events import Event, RunEnded, RunStats, StepEnded

LOGGERS = ("jsonl", "tensorboard", "wandb")
# step row fields that become scalars (the rest are lists or bookkeeping)
_STEP_SCALARS = {"reward_mean": "rollout/reward_mean", "reward_n": "rollout/reward_n", "groups": "train/groups",
                 "micro_batches": "train/micro_batches", "loss": "train/loss", "ratio_mean": "train/ratio_mean",
                 "kl_old_max": "train/kl_old_max", "grad_norm": "train/grad_norm",
                 "clip_frac": "train/clip_frac", "audit_mismatched_tokens": "train/audit_mismatched_tokens",
                 "staleness_mean": "lag/steps_mean", "staleness_max": "lag/steps_max",
                 "staleness_token_mean": "lag/steps_token_mean", "lag_syncs_mean": "lag/syncs_mean",
                 "lag_syncs_max": "lag/syncs_max", "reduce_s": "time/reduce_s", "push_s": "time/push_s",
                 "t_end": "time/wall_s"}
_CELL_SCALARS = ("utilisation", "busy_rollout_s", "busy_train_s", "switching_s", "idle_s")


def available(name: str) -> bool:
    """Whether a logger's library can be imported here (jsonl needs none)."""
    if name == "tensorboard":
        return importlib.util.find_spec("tensorboard") is not None  # torch.utils.tensorboard needs it
    if name == "wandb":
        return importlib.util.find_spec("wandb") is not None
    return name == "jsonl"


def step_scalars(row: dict, stats: RunStats, t1: float) -> dict[str, float]:
    """The flat scalars of one step: its row, the lag so far and each cell's time so far."""
    out = {key: float(row[k]) for k, key in _STEP_SCALARS.items() if row.get(k) is not None}
    cells = [stats.cell_time(c, t1) for c in stats.cell_ids()]
    for c in cells:
        for k in _CELL_SCALARS:
            out[f"cell{c['cell']}/{k}"] = float(c[k])
    wall = sum(c["wall_s"] for c in cells)
    if wall > 0:
        busy = sum(c["busy_rollout_s"] + c["busy_train_s"] for c in cells)
        out["cells/utilisation"] = busy / wall
        out["cells/idle_share"] = sum(c["idle_s"] for c in cells) / wall
        out["cells/switching_share"] = sum(c["switching_s"] for c in cells) / wall
    return out


class MetricsSink:
    def __init__(self, run_dir: str | Path, loggers: list[str] | tuple[str, ...] = LOGGERS, *, name: str = "gyre",
                 config: dict | None = None, wandb_mode: str = "offline") -> None:
        bad = [x for x in loggers if x not in LOGGERS]
        if bad:
            raise ValueError(f"run.loggers: {bad} not known; choose from {', '.join(LOGGERS)}")
        self.dir = Path(run_dir)
        self.path = self.dir / "metrics.jsonl"
        self._jsonl = open(self.path, "a", buffering=1)   # always: the one every tool can read
        self.active, self.skipped, self.errors = ["jsonl"], [], []
        self._tb = self._wb = None
        if "tensorboard" in loggers:
            if available("tensorboard"):
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(self.dir / "tensorboard"))
                self.active.append("tensorboard")
            else:
                self.skipped.append("tensorboard (not installed: pip install tensorboard)")
        if "wandb" in loggers:
            if available("wandb"):
                self._wb = self._start_wandb(name, config or {}, wandb_mode)
            else:
                self.skipped.append("wandb (not installed: pip install wandb)")

    def _start_wandb(self, name: str, config: dict, mode: str):
        import wandb

        try:
            run = wandb.init(project=name, dir=str(self.dir), mode=mode, config=config, reinit="create_new",
                             settings=wandb.Settings(console="off", silent=True, x_disable_stats=True,
                                                     disable_git=True, save_code=False))
        except Exception as e:  # a W&B account problem must not stop the run: the jsonl has it all
            self.errors.append(f"wandb ({mode}) did not start: {e}; set run.wandb_mode=offline "
                               f"or drop wandb from run.loggers")
            return None
        self.active.append("wandb")
        return run

    def on_event(self, ev: Event, stats: RunStats, row: dict | None = None) -> None:
        """Log what an event completed: a step (its row, from `stats`) or the end of the run."""
        if isinstance(ev, StepEnded) and row is not None:
            self.log(row["step"], step_scalars(row, stats, ev.t_end), t=row["t_end"])
        elif isinstance(ev, RunEnded):
            lag = stats.lag()
            step = stats.steps[-1]["step"] + 1 if stats.steps else 0  # W&B steps only grow
            self.log(step, {f"run/lag_{k}": float(v) for k, v in asdict(lag).items()}, t=ev.t - stats.t0)

    def log(self, step: int, scalars: dict[str, float], *, t: float | None = None) -> None:
        self._jsonl.write(json.dumps({"step": step, "t": t, **scalars}) + "\n")
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, global_step=step)
            self._tb.flush()
        if self._wb is not None:
            self._wb.log(scalars, step=step)

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wb is not None:
            import wandb

            self._wb.finish()
            wandb.teardown()  # stops W&B's service: only then is the offline run file complete
            self._wb = None

    def describe(self) -> dict:
        return {"active": list(self.active), "skipped": list(self.skipped), "errors": list(self.errors)}
