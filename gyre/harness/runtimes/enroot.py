"""enroot (the runtime behind Slurm's pyxis) on a squashfs image (``enroot import`` output).

    enroot create --name NAME IMAGE.sqsh
    enroot start --rw --mount SRC:DST:none:x-create=auto,rbind[,ro] --env NAME ... NAME ARGV...
    enroot remove --force NAME

A container is created per instance and removed after it, so each instance starts fresh;
``--rw`` lets task commands write into that throw-away copy. ``--env NAME`` passes the value
from enroot's own environment (never on the argv).

What enroot cannot do: it shares the host's network and pid namespaces (enroot isolates mounts
and the user only), so under enroot a harness can see other processes and reach the network;
Gyre's per-execution keys are then the only guard of the proxy. Prefer Apptainer or bwrap
where that matters.
"""

from __future__ import annotations

import re

from gyre.harness.runtimes import ImageRef, Instance, Launch, Runtime, image_file

_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


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
        for m in inst.mounts:
            argv += ["--mount", f"{m.src}:{m.dst}:none:x-create=auto,rbind" + ("" if m.writable else ",ro")]
        for k in sorted(inst.env):
            argv += ["--env", k]
        # enroot start has no working-directory option: the command changes into it
        argv += [name, "/bin/sh", "-c", 'cd "$0" && exec "$@"', inst.workdir, *inst.argv]
        return Launch(argv, env=dict(inst.env),
                      setup=[[self.program, "create", "--name", name, inst.image.location]],
                      teardown=[[self.program, "remove", "--force", name]])
