"""Where one cell's processes run: decided by the driver (gyre.cluster.placement), used here.

Local processes (``srun`` None: the engine's and trainer's ranks are children on this machine)
or a Slurm step over the cell's nodes (``srun`` is the step prefix each child step starts with).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    nodes: tuple[str, ...] = ()           # the cell's nodes; () = this machine
    srun: tuple[str, ...] | None = None   # Slurm step prefix for the cell's children; None = local
    advertise: str = "127.0.0.1"          # the host others reach this cell's services on (trainer store)
    trainer_ranks: int = 1                # trainer processes over the cell's nodes

    @property
    def in_slurm_step(self) -> bool:
        return self.srun is not None
