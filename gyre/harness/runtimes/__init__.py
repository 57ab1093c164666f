"""Where a harness or an evaluation runs: one seam, one small module per runtime.

A runtime turns an :class:`Instance` (argv, working directory, mounts, environment, network or
not, and an image or the host's own root) into the host command line that starts one fresh
instance of it, plus any set-up and tear-down commands (enroot creates and removes a container).

    bwrap       bubblewrap: the host root (curated, read-only) or an unpacked image rootfs
    apptainer   Apptainer / Singularity ``exec`` of a SIF file or a sandbox directory
    enroot      enroot (Slurm's pyxis) on a squashfs image
    podman      podman / docker ``run --rm`` of a local image

Limits that bound the node: each runtime sizes the instance's in-memory scratch (``/tmp``,
``/dev/shm``) to ``Instance.tmpfs_mb`` and caps its tasks at ``Instance.process_cap`` with its own
documented flags where it has them; the in-instance launcher sets RLIMIT_NPROC where the instance
has a user namespace of its own (gyre.harness.sandbox_init). What a runtime cannot bound it says
in ``Runtime.unbounded``, and Gyre warns of it once (gyre.harness.sandbox).

Secrets (the execution's API key) go through the environment of the runtime's own process, never
its argv: bwrap and enroot pass named variables through, Apptainer reads ``APPTAINERENV_*``,
podman/docker read ``-e NAME`` from the client's environment.
"""

from __future__ import annotations

from gyre.harness.runtimes.apptainer import Apptainer
from gyre.harness.runtimes.base import (RUNTIMES, ImageRef, Instance, Launch, Mount, Runtime,  # noqa: F401 (the package's API)
                                        RuntimeUnavailable, image_file)
from gyre.harness.runtimes.bwrap import Bwrap
from gyre.harness.runtimes.enroot import Enroot
from gyre.harness.runtimes.oci import Oci


def get_runtime(name: str) -> Runtime:
    if name == "bwrap":
        return Bwrap()
    if name in ("apptainer", "singularity"):
        return Apptainer(name)
    if name == "enroot":
        return Enroot()
    if name in ("podman", "docker"):
        return Oci(name)
    raise ValueError(f"unknown runtime {name!r}; known: {', '.join(RUNTIMES)}")
