"""Command lines that start SGLang (or its stand-in) as a cell's engine, one server process per node.

Written against ``python -m sglang.launch_server`` of SGLang 0.5.23 (flag names checked against the
parser its ``server_args.py`` builds; see :mod:`gyre.engine.sglang_flags`). It cannot run on CPU
machines; tests run the same command lines with ``gyre.engine.sglang_standin`` as the module.

What a Gyre cell needs from it:
- ``--skip-tokenizer-init``: the proxy sends ``input_ids`` and reads ``output_ids`` (token truth);
- ``--enable-memory-saver``: ``/release_memory_occupation`` and ``/resume_memory_occupation`` for
  role switches (released weights are freed, so the cell agent loads weights after a resume); it
  needs CUDA (torch_memory_saver), so it is passed only when the cell has GPUs
  (``sched.gpus_per_node`` > 0);
- ``--tp-size`` over the cell's GPUs (SGLang asserts it is divisible by ``--nnodes``), and
  ``--nnodes/--node-rank/--dist-init-addr`` when a cell spans several nodes: one server process per
  node, node rank 0 serves HTTP, the others join through node 0's dist-init address. (``--tp`` also
  works on SGLang only as an argparse prefix of ``--tp-size``; the exact name is used here.)
- hybrid linear-attention models (Qwen3-Next, Qwen3.5: ``hybrid``): ``--mamba-ssm-dtype float32``
  keeps the Gated DeltaNet recurrent state in float32, as the trainer computes it (behaviour
  log-probs closer to the trainer's), and ``--mamba-radix-cache-strategy extra_buffer`` makes the
  hybrid radix cache (``MambaRadixCache``) also checkpoint states during decode every
  ``--mamba-track-interval`` tokens, so an agent's next call (its previous input + output + new
  messages) resumes from a stored state instead of recomputing its prefix; the state pool's share
  of memory stays SGLang's ``--mamba-full-memory-ratio`` default (gyre/sim/roofline.py models it).
  An ``engine.sglang_args`` flag of the same name comes later and wins.
- ``--api-key``: the job's engine secret (SGLang takes it only on the command line; on a shared
  cluster prefer nodes allocated exclusively, since ``ps`` shows arguments).
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field

_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


@dataclass
class SGLangSpec:
    model_path: str
    host: str = "0.0.0.0"
    port: int = 30000
    api_key: str | None = None
    tp: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str = ""          # host:port of node 0 of the cell, when nnodes > 1
    mem_fraction_static: float | None = None
    weight_version: str = "0"
    launcher: str = "sglang.launch_server"  # the module run with ``python -m``
    hybrid: bool = False              # Gated DeltaNet layers: the hybrid radix cache flags
    memory_saver: bool = True         # --enable-memory-saver (a CUDA library): only where CUDA is
    extra: list[str] = field(default_factory=list)

    def check(self) -> None:
        if not _MODULE.match(self.launcher):
            raise ValueError(f"engine.sglang_launcher {self.launcher!r} is not a module name; "
                             "use e.g. sglang.launch_server or gyre.engine.sglang_standin")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("a cell spanning several nodes needs dist_init_addr (node 0's host:port)")
        if self.tp < 1 or self.tp % self.nnodes:
            raise ValueError(f"--tp-size {self.tp} must be a positive multiple of the cell's {self.nnodes} "
                             "node(s) (SGLang asserts tp_size % nnodes == 0); set engine.tp_size")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node rank {self.node_rank} is outside 0..{self.nnodes - 1}")

    def command(self, python: str = sys.executable, node_rank: int | str | None = None) -> list[str]:
        """The launch command of one node; ``node_rank`` overrides ``self.node_rank`` (a string such
        as ``"$r"`` when a shell picks the rank per node)."""
        self.check()
        cmd = [python, "-m", self.launcher, "--model-path", self.model_path,
               "--host", self.host, "--port", str(self.port), "--tp-size", str(self.tp),
               "--skip-tokenizer-init", *(["--enable-memory-saver"] if self.memory_saver else []),
               "--weight-version", self.weight_version,
               "--enable-priority-scheduling"]  # the proxy's fair share (gyre.proxy.fairness)
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        if self.nnodes > 1:
            rank = self.node_rank if node_rank is None else node_rank
            cmd += ["--nnodes", str(self.nnodes), "--node-rank", str(rank),
                    "--dist-init-addr", self.dist_init_addr]
        if self.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", str(self.mem_fraction_static)]
        if self.hybrid:
            cmd += ["--mamba-ssm-dtype", "float32", "--mamba-radix-cache-strategy", "extra_buffer"]
        return cmd + [str(a) for a in self.extra]


def srun_step(spec: SGLangSpec, nodes: list[str], srun: list[str], python: str = sys.executable) -> list[str]:
    """ONE Slurm job step running one server per node of the cell. Each task finds its node rank
    by its Slurm node name (``SLURMD_NODENAME``), so rank 0 is ``nodes[0]`` whatever order Slurm
    numbers the step's nodes in. ``--kill-on-bad-exit``: a node whose server dies ends the step,
    which the agent then sees as a dead engine."""
    if len(nodes) != spec.nnodes:
        raise ValueError(f"{len(nodes)} node names for a spec of {spec.nnodes} node(s)")
    cases = "".join(f"{shlex.quote(n)}) r={i};; " for i, n in enumerate(nodes))
    launch = shlex.join(spec.command(python, node_rank="RANK")).replace("--node-rank RANK", '--node-rank "$r"')
    script = (f'case "$SLURMD_NODENAME" in {cases}*) echo "gyre: node $SLURMD_NODENAME is not one of '
              f'{shlex.quote(",".join(nodes))}" >&2; exit 2;; esac; exec {launch}')
    n = len(nodes)
    return [*srun, f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", f"--nodelist={','.join(nodes)}",
            "--kill-on-bad-exit=1", "bash", "-c", script]

