"""Checks of every path a run needs, before any process starts.

A wrong ``model.path`` used to surface as a traceback on the head rank while mpiexec and the cell
ranks waited for it (hours, under Slurm: the whole allocation). `gyre run` and each rank of a job
call :func:`preflight` on the configuration they built, so a run that cannot start says why in one
line, naming the key to fix, and exits non-zero before anything is launched.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from gyre.config import ConfigError, GyreConfig
from gyre.model.families import ModelFormatError, family_of, read_config

TOKENIZER_FILES = ("tokenizer.json",)  # what gyre.model.tokenizer reads


def check_model_dir(path: str, key: str = "model.path") -> None:
    """A transformers model directory Gyre can serve: config.json of a supported family, weights
    in safetensors and a tokenizer.json; a ConfigError naming what is missing otherwise."""
    d = Path(path).expanduser()
    if not d.is_dir():
        raise ConfigError(f"{key} = {path!r}: no such directory; give a model directory (config.json, "
                          f"*.safetensors, tokenizer.json) or leave {key} empty for the embedded tiny model")
    try:
        family_of(read_config(d))
    except ModelFormatError as e:
        raise ConfigError(f"{key} = {path!r}: {e}") from None
    if not any(d.glob("*.safetensors")):
        raise ConfigError(f"{key} = {path!r}: no *.safetensors file; Gyre reads weights in safetensors "
                          f"(convert with transformers' save_pretrained(..., safe_serialization=True))")
    if not any((d / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"{key} = {path!r}: no tokenizer.json; copy the model's tokenizer files next to "
                          f"its weights (AutoTokenizer.from_pretrained(...).save_pretrained(dir))")


def check_harness_command(command: list) -> None:
    """harness.command is an argv list whose program can be found."""
    if isinstance(command, str) or (len(command) == 1 and len(str(command[0]).split()) > 1
                                    and not Path(str(command[0])).exists()):
        text = command if isinstance(command, str) else command[0]
        raise ConfigError(f"harness.command = {text!r} is one string; write it as a list, "
                          f"e.g. {str(text).split()!r}")
    if not command:
        raise ConfigError("harness.command is empty; e.g. ['{python}', 'my_agent.py', '{prompt_file}']")
    prog = str(command[0])
    if "{" in prog:  # {python} and the like: Gyre's own
        return
    if not (shutil.which(prog) or Path(prog).is_file()):
        raise ConfigError(f"harness.command: program {prog!r} not found (not on PATH, not a file); "
                          f"give its absolute path or '{{python}}' for this Python ({sys.executable})")


def preflight(cfg: GyreConfig) -> None:
    """Every path the run needs exists and has what Gyre reads from it (ConfigError otherwise)."""
    if cfg.model.path:
        check_model_dir(cfg.model.path)
    check_harness_command(cfg.harness.command)
