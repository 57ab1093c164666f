"""podman / docker: ``run --rm`` of a local image (pulled or loaded beforehand).

    podman run --rm -i --network none --pid private --ipc private -w DIR
               [--tmpfs /tmp:rw,exec,nosuid,nodev,mode=1777,size=Nm --shm-size Nm] [--pids-limit N]
               -v SRC:DST[:ro] -e NAME ... IMAGE ARGV...

``-e NAME`` without a value makes the client read the value from its own environment, so keys
never appear on the argv. ``--rm`` throws the container away: each instance starts fresh from
the image, as NL2RepoBench's own scorer does (a container per scoring). podman 4.3 on this
machine imports images but ``run`` fails on setrlimit inside the test container; on a normal
host it works as written.

Limits that bound the node: ``/tmp`` is a tmpfs of ``harness.tmpfs_mb`` (``--tmpfs`` with its
mount options; given options replace the default ``noexec``, so ``exec`` is kept for task commands
that run what they build there) and ``/dev/shm`` is ``--shm-size`` (64 MB when not given); the
container's tasks are capped by the pids cgroup (``--pids-limit``, 2 x ``harness.max_processes`` +
160, as the launcher's RLIMIT_NPROC elsewhere). Rootful docker runs the instance as the host's
root, whom RLIMIT_NPROC never binds: the cgroup is what holds there. Rootless podman on cgroup v1
ignores ``--pids-limit`` (podman says so); the launcher's RLIMIT_NPROC in its user namespace still
holds. Not bounded: the container's writable layer (disk of the image store; ``--storage-opt
size=`` exists only for some storage drivers), so a task command's writes outside its mounts are
bounded by that disk alone.
"""

from __future__ import annotations

import subprocess

from gyre.harness.runtimes.base import ImageRef, Instance, Launch, Runtime


class Oci(Runtime):
    name = "podman"
    program = "podman"
    restricts_network = True
    private_pids = True
    caps_pids = True

    def __init__(self, program: str = "podman"):
        super().__init__(program)
        self.name = program

    def locate(self, image: str, task: str, image_dir: str):
        cmd = [self.program, "image", "inspect", "--format", "{{.Id}}", image]
        try:
            ok = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return ImageRef(self.name, image, image), ""
        return None, f"image {image} is not in {self.program}'s local store; `{self.program} pull {image}`"

    def launch(self, inst: Instance) -> Launch:
        if inst.image is None:
            raise ValueError(f"{self.program} runs images only; the host root is bwrap's")
        name = "gyre-" + "".join(c if c.isalnum() or c in "_.-" else "_" for c in inst.name)
        argv = [self.program, "run", "--rm", "-i", "--name", name, "--ipc", "private",
                "--network", "host" if inst.network else "none", "-w", inst.workdir]
        if self.program == "podman":  # docker's default is a private pid namespace; it has no "private" value
            argv += ["--pid", "private"]
        if inst.tmpfs_mb:  # /tmp is the image's own folder (disk) otherwise; /dev/shm 64 MB
            argv += ["--tmpfs", f"/tmp:rw,exec,nosuid,nodev,mode=1777,size={inst.tmpfs_mb}m",
                     "--shm-size", f"{inst.tmpfs_mb}m"]
        if inst.process_cap:
            argv += ["--pids-limit", str(inst.process_cap)]
        for m in inst.mounts:
            argv += ["-v", f"{m.src}:{m.dst}" + ("" if m.writable else ":ro")]
        for k in sorted(inst.env):
            argv += ["-e", k]
        argv += [inst.image.location, *inst.argv]
        # a killed client leaves its container running: remove it by name afterwards
        return Launch(argv, env=dict(inst.env), teardown=[[self.program, "rm", "--force", name]])
