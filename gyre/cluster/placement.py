"""Where a cell's processes run, decided for the cell agent (gyre.cell takes it as a Placement).

Inside a Slurm job whose ``run_dir/slurm.json`` (written by ``gyre.cluster.slurm prepare`` for
this job) names the cell: a step over the cell's nodes, ``gpus_per_node`` trainer ranks per node
(one where no GPU is visible), reachable by the node's name. Otherwise local processes:
``train.local_ranks`` trainer ranks, reachable on the loopback unless the engine listens on
every interface.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

from gyre.cell.placement import Placement
from gyre.cluster.slurm import cell_step_prefix
from gyre.config import GyreConfig, env


def cell_placement(cfg: GyreConfig, run_dir: str | Path, cell: int) -> Placement:
    nodes = slurm_cell_nodes(Path(run_dir), cell)
    return local_placement(cfg) if nodes is None else slurm_placement(cfg, nodes)


def slurm_cell_nodes(run_dir: Path, cell: int) -> list[str] | None:
    """The cell's nodes under Slurm (run_dir/slurm.json of this job), or None outside a job."""
    path = run_dir / "slurm.json"
    if not env("SLURM_JOB_ID") or not path.exists():
        return None
    cells = json.loads(path.read_text()).get("cells", [])
    return list(cells[cell]["nodes"]) if cell < len(cells) else None


def local_placement(cfg: GyreConfig) -> Placement:
    advertise = socket.getfqdn() if cfg.engine.host in ("0.0.0.0", "") else "127.0.0.1"
    return Placement(advertise=advertise, trainer_ranks=cfg.train.local_ranks)


def slurm_placement(cfg: GyreConfig, nodes: list[str]) -> Placement:
    import torch  # heavy: only a cell rank inside a Slurm job asks how many GPUs it sees

    per_node = cfg.sched.gpus_per_node if torch.cuda.is_available() and cfg.sched.gpus_per_node else 1
    # a step of its own inside the job, sharing the nodes with the agents' and engines' steps
    return Placement(nodes=tuple(nodes), srun=tuple(cell_step_prefix()), advertise=socket.getfqdn(),
                     trainer_ranks=per_node * len(nodes))
