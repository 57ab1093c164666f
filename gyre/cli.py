"""The `gyre` command. Each subcommand lives in its own module, imported only when it runs,
so `gyre --help` is fast and a missing optional dependency only breaks its own command.

A subcommand module provides ``add_arguments(parser)`` and ``run(args) -> int`` (or, where one
module serves several commands, ``<prefix>add_arguments`` and ``<prefix>run``).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from gyre import __version__
from gyre.config import ConfigError

MODEL_CHECKED = ("rollout",)  # commands whose model.path is checked before they start (gyre run: its own preflight)

# name -> (module[:prefix], one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "engine": ("gyre.engine.cli", "serve a model over SGLang's RL HTTP subset (embedded engine)"),
    "proxy": ("gyre.proxy.cli", "run the token-in/token-out OpenAI-compatible proxy"),
    "make-model": ("gyre.model.cli", "build the embedded tiny Qwen-style model offline"),
    "tasks": ("gyre.harness.tasks_cli", "list a suite's tasks, whether each can be scored here and why not"),
    "rollout": ("gyre.offline_rollout", "run G executions per task through the proxy, evaluate them, write shards"),
    "validate": ("gyre.offline_rollout:validate_", "one validation round ([validate]: held-out tasks, n samples, "
                 "pass@1/pass@k, mean reward) on the model or a run's weights"),
    "run": ("gyre.cluster.local", "run the online RL job on this machine (head + cells under mpiexec)"),
    "train": ("gyre.train.cli", "policy-gradient steps from evaluated executions in HDF5 shards"),
    "export": ("gyre.train.export_cli", "write a run's trained model (a step) as a transformers directory"),
    "submit": ("gyre.cluster.slurm:submit_", "write and submit the heterogeneous Slurm job (launchers/gyre.sbatch)"),
    "status": ("gyre.cluster.slurm:status_", "show a run's cells, roles and progress"),
    "inspect": ("gyre.traj.inspect", "summarise an HDF5 trajectory shard, draw one execution's tree"),
    "plan": ("gyre.sim.plan", "sweep cell layouts and schemes for a workload (for HPC admins)"),
    "config": ("gyre.report.config_file:config_", "print the resolved configuration (`gyre config show`) or the "
               "configuration reference (`gyre config reference`)"),
}


def option_hint(unknown: list[str], argv: list[str]) -> str:
    """For `gyre run --steps 3`: configuration keys are not options; name the override to write."""
    import dataclasses

    from gyre.config import GyreConfig

    cfg = GyreConfig()
    known: dict[str, str] = {}
    for sec in dataclasses.fields(cfg):  # the first section that has the name (run.steps before sim.steps)
        for f in dataclasses.fields(getattr(cfg, sec.name)):
            known.setdefault(f.name, sec.name)
    out = []
    for word in unknown:
        name, _, value = word.lstrip("-").partition("=")
        key = name.replace("-", "_")
        if not word.startswith("--") or key not in known:
            continue
        i = argv.index(word)
        if not value and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            value = argv[i + 1]
        out.append(f"{known[key]}.{key}={value or 'VALUE'}")
    return f"; configuration keys are not options: write {' '.join(out)}" if out else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gyre", description="Gyre: Slurm-native online RL for LLM agents on xLong tasks.")
    parser.add_argument("--version", action="version", version=f"gyre {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    argv = sys.argv[1:] if argv is None else argv
    wanted = argv[0] if argv and not argv[0].startswith("-") else None
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:
            modname, _, prefix = module.partition(":")
            mod = importlib.import_module(modname)
            getattr(mod, prefix + "add_arguments")(p)
            p.set_defaults(_run=getattr(mod, prefix + "run"))
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        sub_parser = sub.choices.get(args.command) if args.command else None
        (sub_parser or parser).error(f"unrecognized arguments: {' '.join(unknown)}{option_hint(unknown, argv)}")
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0 if args.command is None else 2

    from gyre.model.families import ModelFormatError

    try:
        if args.command in MODEL_CHECKED:  # a wrong model.path is one line here, not a traceback from deep inside
            from gyre.cluster.preflight import check_model_dir
            from gyre.config import load_config

            cfg = load_config(args.config, args.overrides)
            if cfg.model.path:
                check_model_dir(cfg.model.path)
        return int(args._run(args) or 0)
    except ConfigError as e:
        print(f"gyre {args.command}: configuration error: {e}", file=sys.stderr)
        return 2
    except ModelFormatError as e:  # a model directory Gyre cannot read (family, config, weights)
        print(f"gyre {args.command}: model error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
