"""What every runtime shares: the instance to run, the launch that runs it, the Runtime interface,
and image lookup. Each runtime module imports this one; the package's table (``__init__``) imports
the runtimes, so nothing imports back up."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

RUNTIMES = ("bwrap", "apptainer", "singularity", "enroot", "podman", "docker")


@dataclass(frozen=True)
class Mount:
    src: str          # host path
    dst: str          # path inside the instance
    writable: bool = False


@dataclass(frozen=True)
class ImageRef:
    runtime: str      # which runtime runs it (one of RUNTIMES)
    location: str     # SIF path, sandbox or rootfs directory, squashfs path, or OCI image name
    name: str         # the benchmark's image name (for messages)


@dataclass
class Instance:
    argv: list[str]
    workdir: str = "/workspace"
    mounts: list[Mount] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # the whole environment inside
    network: bool = False  # False: loopback only, where the runtime can restrict it
    image: ImageRef | None = None  # None: the host root (bwrap only)
    masks: list[str] = field(default_factory=list)  # host paths hidden under an empty tmpfs (bwrap host mode)
    name: str = "gyre"  # instance name, where the runtime names containers
    tmpfs_mb: int = 0  # size of each writable tmpfs (/tmp, /dev/shm) where the runtime can size it; 0 = unsized
    process_cap: int = 0  # tasks (processes and threads) at once, where the runtime caps them itself (cgroup pids); 0 = none


@dataclass
class Launch:
    argv: list[str]                 # the host command that runs the instance to its end
    env: dict[str, str]             # the environment to start it with
    setup: list[list[str]] = field(default_factory=list)     # run before, each must succeed
    teardown: list[list[str]] = field(default_factory=list)  # run after, errors ignored


class RuntimeUnavailable(RuntimeError):
    """The runtime's program is not installed, or cannot run this instance."""


class Runtime:
    name = ""
    program = ""
    restricts_network = False   # can give an instance loopback only
    private_pids = False        # an instance sees only its own processes
    private_users = False       # an instance always runs in a user namespace of its own (RLIMIT_NPROC counts it alone)
    caps_pids = False           # the runtime caps an instance's tasks itself (Instance.process_cap)

    def __init__(self, program: str | None = None):
        self.program = program or self.program

    def missing(self) -> str | None:
        """Why this runtime cannot be used on this machine, or None."""
        return None if shutil.which(self.program) else f"{self.program} is not installed (not on PATH)"

    def locate(self, image: str, task: str, image_dir: str) -> tuple[ImageRef | None, str]:
        """The local artefact of ``image`` for ``task``; (None, why not) when absent."""
        raise NotImplementedError

    def launch(self, inst: Instance) -> Launch:
        raise NotImplementedError

    def unbounded(self, tmpfs_mb: int, max_processes: int) -> list[str]:
        """The node limits asked for (``harness.tmpfs_mb``, ``harness.max_processes``; 0 = not asked)
        that this runtime cannot hold, each a sentence naming its key and how to hold it."""
        return []


def image_file(image_dir: str, task: str, suffixes: tuple[str, ...]) -> Path | None:
    """``<image_dir>/<task><suffix>`` for the first suffix that exists."""
    if not image_dir:
        return None
    for s in suffixes:
        p = Path(image_dir).expanduser() / f"{task}{s}"
        if p.exists():
            return p
    return None
