"""`gyre train --config FILE --shards PATH... [--steps N] [--out DIR] [section.key=value ...]`

Offline policy-gradient steps from evaluated executions in HDF5 shards, with the configured
trainer backend (``train.backend``: embedded torch or Megatron-Core), from ``model.path`` or the
embedded tiny model. What it does, in order:

1. Reads every shard named (files, or directories holding ``*.h5``). Before reading the
   executions it compares each shard's recorded tokenizer identity with the model's
   (``gyre_identity.json``): training on tokens of another tokenizer would break token truth
   (ARCHITECTURE.md invariant 1), so a mismatch is an error. A shard recorded with other
   *weights* of the same tokenizer is normal (the policy moved on) and only noted. An
   unreadable shard is an error too, unless ``--skip-bad-shards``.
2. Keeps executions that finished (done, failed, crashed, timeout) with a finite reward; the
   others (unscorable, not evaluated, still running, stopped) are counted and listed by reason,
   never trained silently or dropped silently.
3. Splits the kept executions into steps by whole GRPO groups (``(task, group)``):
   ``--groups-per-step G`` groups per step, taken in shard order and cycled; by default every
   step takes every group (several passes over the same batch, as PPO epochs do: the importance
   ratio against the recorded behaviour log-probs and the clip keep later passes honest).
4. Per step: selection (``selection.k``, ``selection.role_priority``), materialization
   (``train.layout``, ``train.micro_batch_tokens``), forward/backward of each micro-batch and one
   optimizer step; one table row per step (loss, grad norm, tokens, time, executions and
   trajectories used).
5. At the end, under ``--out`` (default ``<run.dir>/train``): ``weights/`` in the engine's layout
   (config.json, model.safetensors, the source model's tokenizer files and a fresh
   ``gyre_identity.json``; the directory is replaced atomically), ``checkpoint/`` (model and
   optimizer state, resumable with ``Trainer.load_checkpoint``) and ``train.json`` (per-step
   statistics, counts, shards, model identities).

The policy version of the s-th step (from 0) is ``v0 + s`` where v0 is the newest policy version that served
any execution read (so the freshest execution has staleness 0 at the first step); staleness
feeds ``train.staleness_weights``. Exit status: 0 done, 2 bad input or configuration (with a
message saying what to fix), 1 anything else.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from gyre.config import ConfigError, default_tiny_dir, load_config, trainer_config
from gyre.fsio import atomic_dir, atomic_write_text
from gyre.model.identity import model_identity, write_identity
from gyre.model.tiny import ensure_tiny_model
from gyre.traj.record import FINISHED
from gyre.traj.select import SelectionSpec
from gyre.train.step_stats import lag0_warning

# files of a transformers model directory that the engine needs besides the weights
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json")
_OVERRIDE = re.compile(r"^[A-Za-z_][\w-]*(\.[A-Za-z_][\w-]*)+=")


class InputError(Exception):
    """Bad input (shards, model, selection/budget combination): exit 2 with this message."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="Gyre TOML configuration file")
    p.add_argument("--shards", nargs="+", required=True, metavar="PATH",
                   help="trajectory shards (.h5) or directories holding them")
    p.add_argument("--steps", type=int, default=1, metavar="N", help="optimizer steps (default 1)")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="where weights/, checkpoint/ and train.json go (default <run.dir>/train)")
    p.add_argument("--groups-per-step", type=int, default=0, metavar="G",
                   help="GRPO groups per step, cycled in shard order (default 0: all, every step)")
    p.add_argument("--skip-bad-shards", action="store_true",
                   help="report unreadable shards and go on (default: stop with exit 2)")
    p.add_argument("--no-verify", action="store_true", help="skip shard checksum verification")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="configuration overrides, e.g. selection.k=all train.layout=expanded")


# --- reading ---------------------------------------------------------------------------------

@dataclass
class Loaded:
    records: list = field(default_factory=list)          # trainable ExecutionRecords
    read: int = 0
    not_trained: Counter = field(default_factory=Counter)  # reason -> executions
    bad_shards: list[str] = field(default_factory=list)
    shards: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _split_overrides(args: argparse.Namespace) -> None:
    """`--shards a.h5 train.lr=1e-5` puts the override into --shards (nargs='+'): move it back."""
    keep = []
    for s in args.shards:
        if _OVERRIDE.match(s) and not os.path.exists(s):
            args.overrides.append(s)
        else:
            keep.append(s)
    args.shards = keep


def _shard_files(paths: list[str]) -> list[Path]:
    from gyre.traj.store import shard_paths  # h5py: loaded when the command runs, not at `--help`

    if not paths:
        raise InputError("no shards given: pass --shards FILE.h5 or a directory of shards")
    missing = [p for p in paths if not Path(p).exists()]
    if missing:
        raise InputError(f"no such shard file or directory: {', '.join(missing)}")
    files = shard_paths(paths)
    if not files:
        raise InputError(f"no shards (*.h5) in {', '.join(paths)}")
    return files


def _reason(rec) -> str | None:
    """Why an execution does not train, or None if it does."""
    if rec.status not in FINISHED:
        return f"status {rec.status}"
    if not math.isfinite(rec.reward):
        return f"no reward ({rec.reward_source or 'not evaluated'})"
    return None


def load_executions(files: list[Path], identity: dict, vocab_size: int, *,
                    verify: bool = True, skip_bad: bool = False) -> Loaded:
    from gyre.traj.store import ShardError, read_attrs, read_shard  # h5py, as above

    out = Loaded()
    want_tok = identity.get("tokenizer_hash")
    other_models: set[str] = set()
    for path in files:
        try:
            attrs = read_attrs(path)
            tok = attrs.get("identity_tokenizer")
            if want_tok and tok and str(tok) != want_tok:
                raise InputError(
                    f"{path}: recorded with tokenizer {str(tok)[:16]}..., but the model "
                    f"({identity.get('name', '?')}) has tokenizer {want_tok[:16]}...: its token "
                    f"ids mean other text; train the model that served these executions "
                    f"(model.path)")
            model = attrs.get("identity_model")
            if model and model != identity.get("model_hash"):
                other_models.add(str(model))
            records = read_shard(path, verify=verify)
        except ShardError as e:
            if not skip_bad:
                raise InputError(f"bad shard: {e} (pass --skip-bad-shards to train on the rest)") from None
            print(f"gyre train: skipping bad shard: {e}", file=sys.stderr)
            out.bad_shards.append(str(path))
            continue
        out.shards.append(str(path))
        if not records:
            out.notes.append(f"{path}: no executions")
        for rec in records:
            out.read += 1
            why = _reason(rec)
            if why:
                out.not_trained[why] += 1
                continue
            top = max((int(n.tokens.max()) for n in rec.tree.nodes if len(n.tokens)), default=-1)
            if top >= vocab_size:
                raise InputError(
                    f"{path}: execution {rec.execution_id} holds token id {top}, outside the model's "
                    f"vocabulary of {vocab_size}: the shard was recorded with another model/tokenizer")
            out.records.append(rec)
    if other_models:
        out.notes.append(f"executions recorded with other weights ({len(other_models)} model hash(es), "
                         f"e.g. {sorted(other_models)[0][:16]}...): trained as off-policy data")
    return out


def step_plan(records: list, steps: int, groups_per_step: int) -> list[list]:
    """Records of each step: whole (task, group) groups, ``groups_per_step`` of them, cycled."""
    groups: dict[tuple[str, int], list] = {}
    for r in records:
        groups.setdefault((r.task, r.group), []).append(r)
    order = list(groups.values())
    if groups_per_step <= 0 or groups_per_step >= len(order):
        return [records] * steps
    return [[r for k in range(groups_per_step) for r in order[(s * groups_per_step + k) % len(order)]]
            for s in range(steps)]


# --- model and output files ------------------------------------------------------------------

def resolve_model(cfg) -> Path:
    if cfg.model.path:
        path = Path(cfg.model.path)
        if not path.is_dir():
            raise InputError(f"model.path: {path} is not a directory")
        if not any(path.glob("*.safetensors")) or not (path / "config.json").exists():
            raise InputError(f"model.path: {path} holds no transformers model "
                             f"(config.json and *.safetensors)")
        return path
    return ensure_tiny_model(default_tiny_dir(cfg), cfg.model.tiny_family)


def export_engine_dir(trainer, model_dir: Path, dest: Path, version: int) -> dict:
    """Weights in the engine's layout plus the source's tokenizer files and a new identity,
    all in one atomic directory replacement; returns the new identity."""

    with atomic_dir(dest) as tmp:
        staged = Path(trainer.export_weights(tmp / "export", version))
        for f in staged.iterdir():
            os.replace(f, tmp / f.name)  # within the directory atomic_dir publishes
        staged.rmdir()
        for name in TOKENIZER_FILES:
            if (model_dir / name).exists() and not (tmp / name).exists():
                shutil.copyfile(model_dir / name, tmp / name)
        return write_identity(tmp, f"{model_dir.name}-train-v{version}")


# --- the command -----------------------------------------------------------------------------

COLUMNS = ("step", "execs", "trajs", "mbs", "tokens", "targets", "loss", "grad norm", "clip frac",
           "fwd-bwd s", "time s")


def _console():
    from rich.console import Console

    # piped output (logs, tests) gets whole lines instead of rich's 80-column default
    return Console(width=None if sys.stdout.isatty() else 160, markup=False, highlight=False)


def _row(st: dict) -> list[str]:
    return [str(st["step"]), str(st["executions"]), str(st["trajectories"]), str(st["micro_batches"]),
            f"{st['tokens']:,}", f"{st['targets']:,}", f"{st['loss']:+.5f}", f"{st['grad_norm']:.4f}",
            f"{st['clip_frac']:.3f}", f"{st['fwd_bwd_s']:.2f}", f"{st['time_s']:.2f}"]


def train(args: argparse.Namespace) -> int:
    from rich.table import Table

    from gyre.traj.materialize import materialize, prepare_step  # torch: loaded when the command runs

    if args.steps < 1:
        raise InputError(f"--steps must be at least 1, got {args.steps}")
    _split_overrides(args)
    cfg = load_config(args.config, args.overrides)
    spec = SelectionSpec.from_config(cfg.selection)
    files = _shard_files(args.shards)
    model_dir = resolve_model(cfg)
    ident, data = _load(args, files, model_dir)
    console = _console()
    _tell_data(console, files, data)

    # check every step's selection and packing before loading the model, so a budget or selection
    # problem shows at once; steps are built again when they run (they hold copies of the trees)
    v0 = max(0, max(r.max_version for r in data.records))

    def build(recs: list, version: int):
        try:
            batch = prepare_step(recs, spec, step_version=version, estimator=cfg.train.advantage)
            return batch, materialize(batch.executions, layout=cfg.train.layout,
                                      micro_batch_tokens=cfg.train.micro_batch_tokens,
                                      routing=cfg.train.routing_replay) if batch.executions else None
        except ValueError as e:  # a trajectory longer than the budget, a bad estimator...
            raise InputError(str(e)) from None

    steps, skipped_steps = _checked_steps(args, data, spec, lambda recs: build(recs, v0), console)
    if not steps:
        raise InputError(f"no step to train: selection.k={spec.k} picks no trajectory with a target "
                         f"token in these executions")

    from gyre.train.backends import make_trainer  # torch (Megatron-Core for its backend)

    out_dir = args.out or Path(cfg.run.dir) / "train"
    t0 = time.perf_counter()

    trainer = make_trainer(trainer_config(cfg), model_dir, seed=cfg.run.seed)
    console.print(f"trainer: {cfg.train.backend} on {trainer.device}, model {model_dir} "
                  f"({ident.get('model_hash', '?')[:16]}...), loaded in {time.perf_counter() - t0:.1f} s; "
                  f"selection k={spec.k}, layout {cfg.train.layout}, "
                  f"micro_batch_tokens {cfg.train.micro_batch_tokens}")
    table = _table(Table, len(steps))
    history = []
    for recs in steps:
        t_step = time.perf_counter()
        batch, mats = build(recs, v0 + trainer.step)
        st = trainer.train_step(mats, cfg.train.minibatches_per_step)
        st.update(executions=mats.stats.executions, trajectories=mats.stats.trajectories,
                  unique_tokens=mats.stats.unique_tokens, skipped_executions=len(batch.skipped),
                  time_s=time.perf_counter() - t_step)
        history.append(st)
        table.add_row(*_row(st))
        # one line per step while it runs (steps can take minutes); the table comes at the end
        console.print(_step_line(st))
        warning = lag0_warning(st, cfg.train.mismatch_warn_k3)
        if warning:
            console.print(f"warning: step {st['step']}: {warning}")
    console.print(table)

    ckpt = trainer.save_checkpoint(out_dir / "checkpoint")
    new_ident = export_engine_dir(trainer, model_dir, out_dir / "weights", trainer.step)
    summary = {
        "steps": history, "skipped_steps": skipped_steps, "shards": data.shards,
        "bad_shards": data.bad_shards, "executions_read": data.read,
        "executions_trainable": len(data.records), "not_trained": dict(data.not_trained),
        "model_dir": str(model_dir), "model_identity": ident, "exported_identity": new_ident,
        "policy_version_start": v0, "backend": cfg.train.backend, "layout": cfg.train.layout,
        "selection_k": spec.k, "weights": str(out_dir / "weights"), "checkpoint": str(ckpt),
    }
    atomic_write_text(out_dir / "train.json", json.dumps(summary, indent=1, default=str) + "\n", mode=0o644)
    console.print(f"weights (engine layout, version {trainer.step}): {out_dir / 'weights'}  "
                  f"model_hash {new_ident['model_hash'][:16]}...\ncheckpoint: {ckpt}\n"
                  f"log: {out_dir / 'train.json'}")
    return 0


def _load(args: argparse.Namespace, files: list, model_dir: Path) -> tuple[dict, object]:
    """The model's identity and the shards' executions read against it (and its vocabulary)."""
    try:
        ident = model_identity(model_dir)
        vocab = int(json.loads((model_dir / "config.json").read_text(encoding="utf-8"))["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"model {model_dir}: cannot read its identity or config: {e}") from None
    return ident, load_executions(files, ident, vocab, verify=not args.no_verify, skip_bad=args.skip_bad_shards)


def _table(table_cls, steps: int):
    """The steps' table (rich.table.Table, imported when the command runs), its columns COLUMNS."""
    table = table_cls(title=f"gyre train: {steps} step(s)", title_justify="left")
    for c in COLUMNS:
        table.add_column(c, justify="right")
    return table


def _step_line(st: dict) -> str:
    return (f"step {st['step']}: loss {st['loss']:+.5f}  grad norm {st['grad_norm']:.4f}  "
            f"tokens {st['tokens']:,}  time {st['time_s']:.2f} s  executions "
            f"{st['executions']}  trajectories {st['trajectories']}")


def _tell_data(console, files: list, data) -> None:
    """What the shards held (notes, executions read, trainable, not trained); none trainable is
    the user's error."""
    for note in data.notes:
        console.print(f"note: {note}")
    dropped = ", ".join(f"{n} {why}" for why, n in sorted(data.not_trained.items()))
    console.print(f"{len(files)} shard(s), {data.read} executions read: {len(data.records)} trainable"
                  + (f"; not trained: {dropped}" if dropped else "")
                  + (f"; {len(data.bad_shards)} bad shard(s) skipped" if data.bad_shards else ""))
    if not data.records:
        raise InputError(f"no trainable executions in {', '.join(map(str, files))}: "
                         f"{data.read} read" + (f", not trained: {dropped}" if dropped else "")
                         + " (training needs finished executions with a finite reward)")


def _checked_steps(args: argparse.Namespace, data, spec, build, console) -> tuple[list, list]:
    """The steps to train (their records) and those skipped (nothing selected), each distinct
    step built once by `build(records)` to check it before the model loads."""
    steps, skipped_steps, checked = [], [], {}
    for s, recs in enumerate(step_plan(data.records, args.steps, args.groups_per_step)):
        key = tuple(id(r) for r in recs)
        if key not in checked:
            batch, mats = build(recs)
            checked[key] = None if mats is not None else (
                "; ".join(sorted({r for _, r in batch.skipped})) or "nothing selected")
        if checked[key] is not None:
            skipped_steps.append({"step_index": s, "reason": checked[key]})
            console.print(f"step {s + 1} of {args.steps}: no trajectory to train ({checked[key]}; "
                          f"selection.k={spec.k}); skipped")
            continue
        steps.append(recs)
    return steps, skipped_steps


def run(args: argparse.Namespace) -> int:
    try:
        return train(args)
    except (InputError, ConfigError) as e:
        kind = "configuration error" if isinstance(e, ConfigError) else "error"
        print(f"gyre train: {kind}: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """`gyre train` on its own (what `gyre train ...` runs once registered in gyre.cli)."""
    p = argparse.ArgumentParser(prog="gyre train", description="optimizer steps from evaluated "
                                "executions in trajectory shards; exports engine weights and a checkpoint")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
