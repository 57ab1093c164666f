"""Run Megatron-Core 0.16.1 on a machine without CUDA (tests, laptops, CI).

Megatron calls CUDA unconditionally in a few places even with `use_cpu_initialization=True`:
`torch.cuda.current_device()` for buffers (global memory buffer, DDP grad buffers), tensors made
with `device='cuda'` in the optimizer and grad-norm code, the CUDA RNG tracker, and an assert that
grads are `torch.cuda.FloatTensor` before clipping. `install()` gives exactly those modules a
`torch` whose CUDA-facing names point at the CPU, and replaces the one asserting function. Torch
itself and every other module are untouched. It is a no-op when CUDA is available.
"""

from __future__ import annotations

import importlib
import types

import torch

MEGATRON_VERSION = "0.16.1"  # the release whose CUDA call sites this file was written against

_MODULES = (  # the modules that hard-code CUDA on the training path
    "megatron.core.utils",
    "megatron.core.tensor_parallel.random",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.distributed.param_and_grad_buffer",
    # MoE: the router moves its weight to the current device; the aux-loss tracker is made on "cuda"
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.moe_utils",
    # expert parallelism: the token dispatcher's gathers allocate on the current device
    "megatron.core.tensor_parallel.mappings",
    # Gated DeltaNet (hybrid families): its constructor puts conv and gate parameters on the
    # current CUDA device
    "megatron.core.ssm.gated_delta_net",
)

_installed = False


def _cpu_device(kwargs: dict) -> dict:
    dev = kwargs.get("device")
    if dev is not None and torch.device(dev).type == "cuda":
        kwargs["device"] = "cpu"
    return kwargs


def _factory(fn):
    return lambda *args, **kwargs: fn(*args, **_cpu_device(kwargs))


class _CudaOnCpu(types.SimpleNamespace):
    """Stands in for `torch.cuda` inside the patched modules."""

    def __getattr__(self, name):  # anything not redirected keeps torch.cuda's behaviour
        return getattr(torch.cuda, name)


_cuda = _CudaOnCpu(
    current_device=lambda: torch.device("cpu"),
    get_rng_state=lambda *a, **k: torch.get_rng_state(),
    manual_seed=torch.manual_seed,
)


class _TorchOnCpu(types.ModuleType):
    """Stands in for `torch` inside the patched modules: CUDA devices become the CPU."""

    cuda = _cuda
    tensor = staticmethod(_factory(torch.tensor))
    zeros = staticmethod(_factory(torch.zeros))

    def __getattr__(self, name):
        return getattr(torch, name)


def _clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Megatron's version minus its `torch.cuda.FloatTensor` assert (fp32 CPU grads are fine)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        torch._foreach_mul_(grads, clip_coeff)


def check_version() -> None:
    import megatron.core

    found = getattr(megatron.core, "__version__", "unknown")
    if found != MEGATRON_VERSION:
        raise RuntimeError(
            f"gyre's CPU layer for Megatron-Core was written for megatron-core=={MEGATRON_VERSION}, "
            f"found {found}; install that version (pip install megatron-core=={MEGATRON_VERSION}) "
            f"or run the Megatron backend on a CUDA machine (train.backend=embedded works anywhere)")


def install() -> bool:
    """Redirect Megatron's CUDA calls to the CPU when CUDA is absent; returns whether it patched.
    Megatron's missing Transformer Engine names are bound on every device."""
    global _installed
    bind_missing_te_names()
    if torch.cuda.is_available() or _installed:
        return _installed
    check_version()
    shim = _TorchOnCpu("torch")
    for name in _MODULES:
        importlib.import_module(name).torch = shim
    rnd = importlib.import_module("megatron.core.tensor_parallel.random")
    # the "CUDA" RNG of the tracker is the CPU generator (dropout is 0 in Gyre's models anyway)
    rnd._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    rnd._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    for name in ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer"):
        mod = importlib.import_module(name)
        if hasattr(mod, "clip_grad_by_total_norm_fp32"):
            mod.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    _installed = True
    return True


def bind_missing_te_names() -> None:
    """Megatron-Core 0.16.1 reads `te_general_gemm` in the MoE router's gating linear but binds it
    only when Transformer Engine imports: without TE every MoE forward is a NameError, on CUDA as on
    the CPU (seen on an H200 without TE). None selects its plain-torch path."""
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
