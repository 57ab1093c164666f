"""Apptainer / Singularity: ``exec`` of a SIF file or a sandbox directory (what HPC sites run).

    apptainer exec --containall --no-home --writable-tmpfs [--net --network none]
                   --pwd DIR --bind SRC:DST[:ro] ... IMAGE ARGV...

``--containall`` gives the instance its own pid and ipc namespaces, a clean environment and a
private /tmp; ``--writable-tmpfs`` lets task commands write anywhere (``pip install``) into a
throw-away overlay, so every ``exec`` is a fresh instance. The environment is handed over as
``APPTAINERENV_NAME`` (``SINGULARITYENV_`` for singularity), which ``--cleanenv`` keeps.
``--network none`` needs a site that allows it for users (apptainer.conf ``allow net networks``;
rootless with ``--userns``/``--fakeroot``); where it is refused, set harness.sandbox_network =
"host" and rely on the proxy's per-execution keys.

Limits that bound the node: Apptainer has no per-run option for the size of any tmpfs. Run by an
ordinary user, ``--containall`` puts ``/tmp``, ``/var/tmp`` and the ``--writable-tmpfs`` overlay in
one session tmpfs sized by the site (``sessiondir max size`` in apptainer.conf, 64 MB by default;
unsized when run as root), and ``/dev/shm`` on a tmpfs of its own with no size at all (node memory
that no process's resident size shows): ``harness.tmpfs_mb`` cannot bound either, and Gyre warns.
``--scratch`` and ``--workdir`` only move such folders to disk. The process cap is the launcher's
RLIMIT_NPROC, which bounds the instance alone only in a user namespace of its own: an
unprivileged installation (the default since Apptainer 1.1) always makes one, a setuid one does
not (unless ``--userns``), and the launcher then leaves it unset and says so. ``--pids-limit``
(cgroups) is not used: run by an ordinary user it needs cgroups v2, systemd as the cgroups manager
and a user session bus, and Apptainer refuses to start the instance where one is missing.
"""

from __future__ import annotations

from gyre.harness.runtimes.base import ImageRef, Instance, Launch, Runtime, image_file


class Apptainer(Runtime):
    name = "apptainer"
    program = "apptainer"
    restricts_network = True
    private_pids = True

    def __init__(self, program: str = "apptainer"):
        super().__init__(program)
        self.name = program

    def locate(self, image: str, task: str, image_dir: str):
        p = image_file(image_dir, task, (".sif", ".simg", ""))
        if p is not None and (p.is_file() or (p / ".singularity.d").is_dir()):
            return ImageRef(self.name, str(p.resolve()), image), ""
        where = f"{image_dir}/{task}.sif" if image_dir else "harness.image_dir (not set)"
        return None, (f"no SIF or sandbox of {image} at {where}; make one with "
                      f"`{self.program} build {image_dir or 'DIR'}/{task}.sif docker://{image}`")

    def launch(self, inst: Instance) -> Launch:
        if inst.image is None:
            raise ValueError("apptainer runs images only; the host root is bwrap's")
        argv = [self.program, "exec", "--containall", "--no-home", "--writable-tmpfs", "--pwd", inst.workdir]
        if not inst.network:
            argv += ["--net", "--network", "none"]
        for m in inst.mounts:
            argv += ["--bind", f"{m.src}:{m.dst}" + ("" if m.writable else ":ro")]
        argv += [inst.image.location, *inst.argv]
        prefix = "SINGULARITYENV_" if self.program == "singularity" else "APPTAINERENV_"
        return Launch(argv, env={prefix + k: v for k, v in inst.env.items()})

    def unbounded(self, tmpfs_mb: int, max_processes: int) -> list[str]:
        why = []
        if tmpfs_mb:
            why.append(f"harness.tmpfs_mb = {tmpfs_mb} does not hold under {self.name}: /dev/shm is its own "
                       f"tmpfs with no size (node memory) and /tmp is sized by the site (`sessiondir max size` "
                       f"in {self.name}.conf, 64 MB by default); run these tasks under bwrap (an unpacked "
                       f"rootfs: `{self.program} build --sandbox`), enroot, podman or docker to bound them")
        if max_processes:
            why.append(f"harness.max_processes = {max_processes}: under {self.name} the kernel's cap "
                       f"(RLIMIT_NPROC) holds only where it runs the instance in a user namespace of its own "
                       f"(an unprivileged installation; a setuid one only with --userns); elsewhere the "
                       f"harness's process poll alone holds and evaluation commands are not capped")
        return why
