"""torch.distributed and Megatron parallel state for the trainer process.

gloo on CPU, nccl on GPU. A process launched alone (tests, `gyre train` on one machine) gets a
world of size 1 on a free local port; under torchrun/srun the usual env:// variables are used.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from gyre.config import env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(*, rank: int | None = None, world_size: int | None = None,
                     init_method: str | None = None) -> None:
    """Initialise the default process group once (no-op if already initialised)."""
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if world_size is None and init_method is None:
        if env("WORLD_SIZE") is None:  # a lone process: its own world of size 1
            rank, world_size = 0, 1
            init_method = f"tcp://127.0.0.1:{_free_port()}"
        else:
            init_method = "env://"
    if backend == "nccl":
        local_rank = int(env("LOCAL_RANK") or rank or 0)
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    kwargs = {} if init_method == "env://" else {"rank": rank, "world_size": world_size}
    dist.init_process_group(backend, init_method=init_method, **kwargs)


def init_megatron(*, tensor_parallel: int = 1, pipeline_parallel: int = 1, expert_parallel: int = 1,
                  context_parallel: int = 1, seed: int = 0) -> None:
    """Megatron's parallel state and RNG tracker (and the CPU layer when CUDA is absent)."""
    from gyre.train import megatron_cpu  # Megatron-Core: only when its parallel state is set up

    megatron_cpu.install()
    init_distributed()
    from megatron.core import parallel_state, tensor_parallel as tp

    if not parallel_state.model_parallel_is_initialized():
        world = torch.distributed.get_world_size()
        if world % (tensor_parallel * pipeline_parallel * expert_parallel) or \
                world % (tensor_parallel * pipeline_parallel * context_parallel):
            raise ValueError(f"a cell of {world} trainer ranks cannot hold tensor_parallel={tensor_parallel} x "
                             f"pipeline_parallel={pipeline_parallel} x expert_parallel={expert_parallel} "
                             f"(context_parallel={context_parallel}); make each product with tensor x "
                             f"pipeline divide the ranks")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel,
                                                 pipeline_model_parallel_size=pipeline_parallel,
                                                 context_parallel_size=context_parallel,
                                                 expert_model_parallel_size=expert_parallel)
    tp.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
