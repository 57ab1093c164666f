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
"""

from __future__ import annotations

from gyre.harness.runtimes import ImageRef, Instance, Launch, Runtime, image_file


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
