"""bubblewrap: a fresh mount, pid, user, ipc, uts (and network) namespace per instance.

Two roots: the host's own (only the system directories a program needs, read-only, plus what the
instance mounts; nothing of /root, /home, /work, the run directory or other workspaces), or an
unpacked image root filesystem (``<image_dir>/<task>/``, e.g. ``apptainer build --sandbox`` or an
``enroot export``/``podman export`` unpacked), its top-level folders mounted read-only: writes go
only to the instance's mounts and its private /tmp. bubblewrap 0.8 has no overlay, so a task command that installs into
the image's site-packages fails there (use Apptainer's --writable-tmpfs or enroot --rw for such
tasks).

Network: ``--unshare-net`` leaves only the instance's own loopback; the harness reaches the
proxy through a Unix socket mounted into it (see gyre.harness.sandbox). bubblewrap cannot filter
traffic by address, so "only the proxy" is made of "no network" plus that one socket.
"""

from __future__ import annotations

import os
from pathlib import Path

from gyre.harness.runtimes.base import ImageRef, Instance, Launch, Runtime, image_file

# Host paths a program needs to run (read-only). /etc is curated: the rest of it (shadow, munge
# and ssh keys, Slurm configs) is none of a harness's business, and as root in a user namespace
# file modes alone would not keep it out.
HOST_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
HOST_ETC = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives",
            "/etc/ssl", "/etc/ca-certificates", "/etc/localtime", "/etc/nsswitch.conf", "/etc/hosts",
            "/etc/passwd", "/etc/group", "/etc/mime.types", "/etc/protocols", "/etc/services")
PATH_INSIDE = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class Bwrap(Runtime):
    name = "bwrap"
    program = "bwrap"
    restricts_network = True
    private_pids = True
    private_users = True

    def locate(self, image: str, task: str, image_dir: str):
        p = image_file(image_dir, task, ("", ".rootfs"))
        if p is not None and p.is_dir() and ((p / "usr").is_dir() or (p / "bin").exists()):
            return ImageRef("bwrap", str(p.resolve()), image), ""
        where = f"{image_dir}/{task}/" if image_dir else "harness.image_dir (not set)"
        return None, (f"no unpacked root filesystem of {image} at {where}; make one with "
                      f"`apptainer build --sandbox {image_dir or 'DIR'}/{task} docker://{image}`")

    def _root_args(self, inst: Instance) -> list[str]:
        args = []
        if inst.image is not None:
            # each top-level entry of the image on bwrap's own tmpfs root, read-only: mount points
            # of the instance's own mounts can then be made even where the image lacks them
            root = Path(inst.image.location)
            for entry in sorted(os.listdir(root)):
                p = root / entry
                if p.is_symlink():
                    args += ["--symlink", os.readlink(p), f"/{entry}"]
                elif entry not in ("proc", "dev", "tmp", "run"):
                    args += ["--ro-bind", str(p), f"/{entry}"]
            return args
        for p in HOST_SYSTEM:
            if os.path.islink(p):  # merged /usr: /bin -> usr/bin
                args += ["--symlink", os.readlink(p), p]
            elif os.path.isdir(p):
                args += ["--ro-bind", p, p]
        for p in HOST_ETC:
            args += ["--ro-bind-try", p, p]
        return args

    def launch(self, inst: Instance) -> Launch:
        uid = os.getuid() or 1000  # root outside is an ordinary uid inside: no program assumes powers
        argv = [self.program, "--die-with-parent", "--unshare-user", "--uid", str(uid), "--gid", str(uid),
                "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                "--hostname", "gyre-sandbox"]
        if not inst.network:
            argv.append("--unshare-net")
        argv += self._root_args(inst)
        # Every tmpfs bwrap makes is memory of the node: /tmp and /dev/shm are the instance's
        # scratch, each sized (harness.tmpfs_mb); the rest (its root, /dev, /run, the masks) is
        # made read-only below once its mount points exist, so nothing unsized can be filled.
        size = ["--size", str(inst.tmpfs_mb << 20)] if inst.tmpfs_mb else []
        argv += ["--proc", "/proc", "--dev", "/dev", *size, "--tmpfs", "/tmp", *size, "--tmpfs", "/dev/shm",
                 "--tmpfs", "/run"]
        # Mounts ordered by depth so that a file inside a mounted folder lands on top of it.
        for m in sorted(inst.mounts, key=lambda m: len(Path(m.dst).parts)):
            argv += ["--bind" if m.writable else "--ro-bind", m.src, m.dst]
        for p in inst.masks:
            argv += ["--tmpfs", p]
        for p in ("/", "/dev", "/run", *inst.masks):
            argv += ["--remount-ro", p]
        # The environment is bwrap's own (it passes it on unchanged): the caller starts bwrap with
        # exactly the instance's environment, so no value (the API key) is ever on an argv, which
        # /proc/PID/cmdline shows to every user of the machine.
        argv += ["--chdir", inst.workdir, "--", *inst.argv]
        return Launch(argv, env=dict(inst.env))
