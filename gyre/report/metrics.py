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
import secrets
import string
from dataclasses import asdict
from pathlib import Path

from gyre.events import Event, RunEnded, RunStats, StepEnded
from gyre.report.health import KINDS

LOGGERS = ("jsonl", "tensorboard", "wandb")
WANDB_ID = "wandb_id"  # in the run directory: the W&B run every session of the run logs to
# Every scalar of a step row (steps.jsonl) under a stable grouped name: rollout/ (what the
# executions did), train/ (the optimizer step), offpolicy/ (lag corrections and train/inference
# mismatch), sched/ (lag, steps, cells taking part, time spent outside training), cells/ (time by
# role), health/ (1 on a step a warning fires). A key no rule names lands in other/ (a test
# forbids that for the rows a run writes), never dropped.
_GROUP = {
    "rollout": ("reward_mean", "reward_n", "reward_std", "executions_ended", "executions_done", "executions_running",
                "harness_failures", "harness_failure_rate", "execution_s_mean", "execution_tokens_mean",
                "calls_per_execution", "call_input_tokens_mean", "call_output_tokens_mean", "tokens_per_s",
                "executions_per_h", "replaced_zero_variance", "replaced_share", "stopped_by_limits"),
    "train": ("loss", "loss_per_target", "grad_norm", "entropy", "learning_rate", "micro_batches", "groups",
              "moe_aux_loss", "ratio_mean", "kl_old_max", "clip_frac", "version", "minibatches", "minibatch_grad_norms",
              "kl_ref_mean", "ref_time_fraction", "ref_memory_bytes",
              "audit_tokens", "audit_mismatched_tokens", "audit_unchecked_tokens"),
    "offpolicy": ("is_weight_mean", "truncated_frac", "masked_frac"),
    "sched": ("step", "staleness_mean", "staleness_max", "staleness_token_mean", "lag_syncs_mean", "lag_syncs_max",
              "pushed", "participants", "reduce_s", "push_s", "t_start", "t_end"),
}
_NAMES = {k: f"{g}/{k}" for g, keys in _GROUP.items() for k in keys}
_PREFIXES = (("mismatch_", "offpolicy"), ("ratio_q", "offpolicy"))
_CELL_SCALARS = ("utilisation", "busy_rollout_s", "busy_train_s", "switching_s", "pushing_s", "idle_s", "failed_s",
                 "rollout_s", "train_s", "switches")


def metric_name(key: str) -> str:
    """The grouped name of a step row's key in every metrics stream."""
    if key in _NAMES:
        return _NAMES[key]
    return next((f"{g}/{key}" for p, g in _PREFIXES if key.startswith(p)), f"other/{key}")


def row_scalars(row: dict) -> dict[str, float]:
    """Every figure of a step row as flat scalars: numbers as they are, booleans 0/1, a list by its
    length (the cells that took part), a dict by its entries (reward per task: rollout/reward_by_task/<task>),
    the health warnings as health/<kind> 1 (0 for the kinds that did not fire)."""
    out: dict[str, float] = {}
    for k, v in row.items():
        if k == "warnings":
            out.update({f"health/{kind}": float(kind in (v or {})) for kind in (*KINDS, *(v or {}))})
        elif isinstance(v, dict):
            out.update({f"rollout/{k}/{sub}": float(x) for sub, x in v.items() if x is not None})
        elif isinstance(v, (list, tuple)):
            out[metric_name(k)] = float(len(v))
        elif isinstance(v, (int, float)):  # bool included
            out[metric_name(k)] = float(v)
    return out


def available(name: str) -> bool:
    """Whether a logger's library can be imported here (jsonl needs none)."""
    if name == "tensorboard":
        return importlib.util.find_spec("tensorboard") is not None  # torch.utils.tensorboard needs it
    if name == "wandb":
        return importlib.util.find_spec("wandb") is not None
    return name == "jsonl"


def step_scalars(row: dict, stats: RunStats, t1: float) -> dict[str, float]:
    """The flat scalars of one step: its row, the lag so far and each cell's time so far."""
    out = row_scalars(row)
    cells = [stats.cell_time(c, t1) for c in stats.cell_ids()]
    for c in cells:
        for k in _CELL_SCALARS:
            out[f"cells/cell{c['cell']}/{k}"] = float(c.get(k, 0.0))
    wall = sum(c["wall_s"] for c in cells)
    if wall > 0:
        busy = sum(c["busy_rollout_s"] + c["busy_train_s"] for c in cells)
        out["cells/utilisation"] = busy / wall
        out["cells/idle_share"] = sum(c["idle_s"] for c in cells) / wall
        out["cells/switching_share"] = sum(c["switching_s"] for c in cells) / wall
    return out


class ScalarWriter:
    """TensorBoard scalars through tensorboard's own event-file writer: the events
    `torch.utils.tensorboard.SummaryWriter.add_scalar` writes (same file, same records: a
    ``simple_value`` per tag, wall time, step), without importing torch, which the head has no
    other use for (~1 s of CPU per job)."""

    def __init__(self, log_dir: Path) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        # SummaryWriter's defaults: a queue of 10 events, flushed every 120 s (and on flush())
        self._writer = EventFileWriter(str(log_dir), 10, 120, "")

    def add_scalar(self, tag: str, value: float, global_step: int) -> None:
        import time

        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(value))])
        self._writer.add_event(Event(summary=summary, wall_time=time.time(), step=int(global_step)))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


class MetricsSink:
    def __init__(self, run_dir: str | Path, loggers: list[str] | tuple[str, ...] = LOGGERS, *, name: str = "gyre",
                 config: dict | None = None, wandb_mode: str = "offline", first_step: int = 0) -> None:
        """`first_step`: the step this session starts at (a resumed run's steps keep growing)."""
        bad = [x for x in loggers if x not in LOGGERS]
        if bad:
            raise ValueError(f"run.loggers: {bad} not known; choose from {', '.join(LOGGERS)}")
        self.dir = Path(run_dir)
        self.first_step = first_step
        self.path = self.dir / "metrics.jsonl"
        self._jsonl = open(self.path, "a", buffering=1)   # always: the one every tool can read
        self.active, self.skipped, self.errors = ["jsonl"], [], []
        self._tb = self._wb = None
        if "tensorboard" in loggers:
            if available("tensorboard"):
                self._tb = ScalarWriter(self.dir / "tensorboard")
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
            # one W&B run for the whole run: its id is kept in the run directory and a resumed
            # session continues it (resume="allow": a first session creates it)
            run = wandb.init(project=name, dir=str(self.dir), mode=mode, config=config, reinit="create_new",
                             id=self._wandb_id(), resume="allow",
                             settings=wandb.Settings(console="off", silent=True, x_disable_stats=True,
                                                     disable_git=True, save_code=False))
        except Exception as e:  # a W&B account problem must not stop the run: the jsonl has it all
            self.errors.append(f"wandb ({mode}) did not start: {e}; set run.wandb_mode=offline "
                               f"or drop wandb from run.loggers")
            return None
        self.active.append("wandb")
        return run

    def _wandb_id(self) -> str:
        """The run's W&B id, from ``<run.dir>/wandb_id`` (written on the first session)."""
        path = self.dir / WANDB_ID
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # W&B's form
        path.write_text(run_id + "\n")
        return run_id

    def on_event(self, ev: Event, stats: RunStats, row: dict | None = None) -> None:
        """Log what an event completed: a step (its row, from `stats`) or the end of the run."""
        if isinstance(ev, StepEnded) and row is not None:
            self.log(row["step"], step_scalars(row, stats, ev.t_end), t=row["t_end"])
        elif isinstance(ev, RunEnded):
            lag = stats.lag()
            step = stats.steps[-1]["step"] + 1 if stats.steps else self.first_step  # W&B steps only grow
            self.log(step, {f"sched/run_lag_{k}": float(v) for k, v in asdict(lag).items()}, t=ev.t - stats.t0)

    def log(self, step: int, scalars: dict[str, float], *, t: float | None = None) -> None:
        self._jsonl.write(json.dumps({"step": step, "t": t, **scalars}) + "\n")
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, global_step=step)
            self._tb.flush()
        if self._wb is not None:
            self._wb.log(scalars, step=step)

    def close(self) -> None:
        """Close every backend; one that fails (W&B whose service a `scancel` already killed raises
        ConnectionResetError) is named in `errors` in one line, never a traceback, and the others
        still close: metrics.jsonl has every figure anyway."""
        for name, closer in (("jsonl", self._jsonl.close), ("tensorboard", self._tb and self._tb.close),
                             ("wandb", self._wb and self._close_wandb)):
            if closer:
                try:
                    closer()
                except Exception as e:  # noqa: BLE001 - the run is over; what it recorded is on disk
                    self.errors.append(f"{name} did not close cleanly ({type(e).__name__}: {e}); "
                                       f"metrics.jsonl holds every figure")
        self._tb = self._wb = None

    def _close_wandb(self) -> None:
        import wandb

        self._wb.finish()
        wandb.teardown()  # stops W&B's service: only then is the offline run file complete

    def describe(self) -> dict:
        return {"active": list(self.active), "skipped": list(self.skipped), "errors": list(self.errors)}
