"""The resolved configuration of a run: written to `run.dir/config.toml` when the run starts, read
back by `--resume` (so overrides are not retyped), and printed by `gyre config show` with the
values that differ from the defaults marked.

The file is TOML that `gyre.config.load_config` reads as it reads any configuration file (every
field of the configuration is a string, number, boolean or a list of those).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from enum import Enum
from pathlib import Path

from gyre.config import ConfigError, GyreConfig, load_config
from gyre.config_reference import reference_markdown
from gyre.fsio import atomic_write_text

FILE = "config.toml"


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, Enum):
        v = v.value
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return repr(v)


def to_toml(cfg: GyreConfig, *, mark_defaults: bool = False) -> str:
    """Every key of every section; with `mark_defaults`, a `# default` comment on the untouched ones
    and `# default: X` on the ones set, so what a run changed stands out."""
    default = GyreConfig()
    out = []
    for sec in dataclasses.fields(cfg):
        out.append(f"[{sec.name}]")
        ours, theirs = getattr(cfg, sec.name), getattr(default, sec.name)
        for f in dataclasses.fields(ours):
            v, d = getattr(ours, f.name), getattr(theirs, f.name)
            line = f"{f.name} = {_value(v)}"
            if mark_defaults:
                line += "  # default" if v == d else f"  # set (default {_value(d)})"
            out.append(line)
        out.append("")
    return "\n".join(out)


def write(cfg: GyreConfig, run_dir: str | Path) -> Path:
    path = Path(run_dir) / FILE
    atomic_write_text(path, "# the resolved configuration of this run (gyre/report/config_file.py);\n"
                            "# `--resume` starts from it, overrides on the command line apply on top\n"
                      + to_toml(cfg))
    return path


def stored(run_dir: str | Path) -> Path | None:
    """The run's resolved configuration file, if it wrote one."""
    path = Path(run_dir) / FILE
    return path if path.is_file() else None


# ---- --resume --config -----------------------------------------------------------------------------
# Keys a resumed run may take from a new --config: how long it goes on, how it is watched and
# logged, and where the engines listen (gyre submit sets engine.host for a cluster's nodes). Every
# other key shapes what was trained or recorded (the model, the schedule, the harness, the loss):
# changing one mid-run would make one run two experiments under one name.
MAY_CHANGE = ("engine.host", "run.steps", "run.heartbeat_timeout_s", "run.loggers", "run.wandb_mode",
              "run.keep_checkpoints", "run.warn_entropy_below", "run.warn_harness_failure_rate",
              "harness.concurrency", "eval.workers")


def _flat(cfg: GyreConfig) -> dict[str, object]:
    return {f"{sec}.{k}": v for sec, keys in dataclasses.asdict(cfg).items() for k, v in keys.items()}


def resumed(run_dir: str | Path, config: str | None, overrides: list[str]) -> tuple[GyreConfig, str]:
    """The configuration a `--resume` runs with, and the file it loads: the run's stored one
    (overrides on top); with a `--config` that differs from it only in MAY_CHANGE keys, that file;
    one that differs in any other key is refused, naming each such key with both values."""
    path = stored(run_dir)
    if path is None:  # a run from before Gyre stored its configuration: the command line's
        return load_config(config, overrides), config
    old = load_config(path, overrides)
    if config is None or Path(config).resolve() == path.resolve():
        return old, str(path)
    new = load_config(config, overrides)
    was, now = _flat(old), _flat(new)
    fixed = [k for k in was if was[k] != now[k] and k not in MAY_CHANGE]
    if fixed:
        said = "; ".join(f"{k}: {_value(was[k])} in the run, {_value(now[k])} in {config}" for k in fixed)
        raise ConfigError(f"--resume --config {config}: {said}. These keys cannot change within a run (only "
                          f"{', '.join(MAY_CHANGE)} can): drop --config to resume with the run's own "
                          f"{path}, or start a new run.dir")
    return new, config


# ---- gyre config show -------------------------------------------------------------------------------
def config_add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="config_command", metavar="SUBCOMMAND", required=True)
    show = sub.add_parser("show", help="print the resolved configuration (file + overrides, or a run's), "
                                       "values that differ from the defaults marked")
    show.add_argument("--config", help="TOML configuration file")
    show.add_argument("--run", metavar="RUN_DIR", help="show the configuration a run stored (run.dir/config.toml)")
    show.add_argument("overrides", nargs="*", help="section.key=value configuration overrides")
    sub.add_parser("reference", help="print the configuration reference (Markdown) generated from gyre/config.py "
                                     "(docs/configuration.md is its output)")


def config_run(args: argparse.Namespace) -> int:
    if args.config_command == "reference":
        print(reference_markdown(), end="")
        return 0
    path = args.config
    if args.run:
        path = stored(args.run)
        if path is None:
            raise SystemExit(f"gyre config show: {args.run} holds no {FILE} (not a run directory, or a run "
                             f"from before Gyre stored its configuration)")
    print(to_toml(load_config(path, args.overrides), mark_defaults=True), end="")
    return 0
