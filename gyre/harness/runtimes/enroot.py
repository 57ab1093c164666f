"""enroot (the runtime behind Slurm's pyxis) on a squashfs image (``enroot import`` output).

    enroot create --name NAME IMAGE.sqsh
    enroot start --rw [--mount tmpfs:/tmp:tmpfs:...,size=Nm --mount tmpfs:/dev/shm:tmpfs:...,size=Nm]
                 --mount SRC:DST:none:x-create=auto,rbind[,ro] --env NAME ... NAME ARGV...
    enroot remove --force NAME

A container is created per instance and removed after it, so each instance starts fresh;
``--rw`` lets task commands write into that throw-away copy. ``--env NAME`` passes the value
from enroot's own environment (never on the argv).

What enroot cannot do: it shares the host's network and pid namespaces (enroot isolates mounts
and the user only), so under enroot a harness can see other processes and reach the network;
Gyre's per-execution keys are then the only guard of the proxy. Prefer Apptainer or bwrap
where that matters. (enroot's sources after 4.1.2 add ``start --pid`` and ``--net``; no release
has them yet.)

Limits that bound the node: enroot's own mounts (its ``mounts.d/10-system.fstab``) give ``/tmp``
an unsized tmpfs and bind the HOST's ``/dev/shm`` (node memory shared with every process of the
node, and a channel between harnesses). ``--mount`` entries are mounted after those, so a sized
tmpfs (``harness.tmpfs_mb``) is put over each of them. The process cap is the launcher's
RLIMIT_NPROC: an unprivileged enroot always starts a user namespace of its own, so the kernel
counts the instance alone (as root there is none, and the kernel exempts root anyway).

What enroot cannot bound here:
- ``/var/run`` and ``/var/lock`` stay enroot's unsized tmpfs: hooks (the NVIDIA one) put sockets
  there, so they are not mounted over; a site bounds them with ``size=`` in that fstab.
- ``--rw`` writes outside the instance's mounts go to the container's copy of the image under
  ``ENROOT_DATA_PATH``: disk, bounded by that file system alone (node memory where a site puts
  ``ENROOT_DATA_PATH`` on a tmpfs).
"""

from __future__ import annotations

import re

from gyre.harness.runtimes.base import ImageRef, Instance, Launch, Runtime, image_file

_SAFE = re.compile(r"[^A-Za-z0-9_.-]")
# enroot's own /tmp options (10-system.fstab), world-writable as a /tmp is, plus the size
_TMPFS_OPTIONS = "x-create=dir,rw,nosuid,nodev,mode=1777"


class Enroot(Runtime):
    name = "enroot"
    program = "enroot"
    restricts_network = False
    private_pids = False

    def locate(self, image: str, task: str, image_dir: str):
        p = image_file(image_dir, task, (".sqsh", ".squashfs"))
        if p is not None and p.is_file():
            return ImageRef("enroot", str(p.resolve()), image), ""
        registry, _, path = image.partition("/")
        where = f"{image_dir}/{task}.sqsh" if image_dir else "harness.image_dir (not set)"
        return None, (f"no squashfs of {image} at {where}; make one with "
                      f"`enroot import -o {image_dir or 'DIR'}/{task}.sqsh docker://{registry}#{path}`")

    def launch(self, inst: Instance) -> Launch:
        if inst.image is None:
            raise ValueError("enroot runs images only; the host root is bwrap's")
        name = _SAFE.sub("_", inst.name)
        argv = [self.program, "start", "--rw"]
        if inst.tmpfs_mb:  # fstab fields, colon-separated (enroot turns each ':' into a field break)
            for dst in ("/tmp", "/dev/shm"):
                argv += ["--mount", f"tmpfs:{dst}:tmpfs:{_TMPFS_OPTIONS},size={inst.tmpfs_mb}m"]
        for m in inst.mounts:
            argv += ["--mount", f"{m.src}:{m.dst}:none:x-create=auto,rbind" + ("" if m.writable else ",ro")]
        for k in sorted(inst.env):
            argv += ["--env", k]
        # enroot start has no working-directory option: the command changes into it
        argv += [name, "/bin/sh", "-c", 'cd "$0" && exec "$@"', inst.workdir, *inst.argv]
        return Launch(argv, env=dict(inst.env),
                      setup=[[self.program, "create", "--name", name, inst.image.location]],
                      teardown=[[self.program, "remove", "--force", name]])

    def unbounded(self, tmpfs_mb: int, max_processes: int) -> list[str]:
        if not tmpfs_mb:
            return []
        return [f"harness.tmpfs_mb = {tmpfs_mb} sizes /tmp and /dev/shm under enroot, but /var/run and "
                "/var/lock stay enroot's own unsized tmpfs (node memory): add size= to their lines in "
                "enroot's mounts.d/10-system.fstab, or run these tasks under bwrap (an unpacked rootfs)"]
