"""Move tensor storage to host memory and back, keeping every tensor object (and view) valid.

Used for role switches: a train cell gives its accelerator memory to inference and later resumes
with bit-identical state. The tensor objects stay where they are (optimizer and DDP keep their
references); only their storage is copied out and released with `resize_(0)`, the same technique
as Megatron's grad-buffer offload. On a CPU-only machine the "device" is host memory too: the
copy-and-release still happens, which keeps the bookkeeping and the bit-identity checks real.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterable

import torch
from torch import Tensor


def sync() -> None:
    """Wait for queued kernels so that timings measure the copies, not their launch."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class HostStash:
    """Holds host copies of storages released from their tensors."""

    def __init__(self) -> None:
        self._held: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = []

    @property
    def nbytes(self) -> int:
        return sum(host.nbytes() for _, host in self._held)

    def offload(self, tensors: Iterable[Tensor]) -> int:
        """Copy each distinct storage to the host and free it; returns the bytes moved."""
        seen = {s.data_ptr() for s, _ in self._held}
        moved = 0
        for t in tensors:
            st = t.untyped_storage()
            if st.nbytes() == 0 or st.data_ptr() in seen:
                continue  # already released, or a view of a storage handled just before
            seen.add(st.data_ptr())
            if st.device.type == "cpu":
                host = st.clone()
            else:
                host = torch.UntypedStorage(st.nbytes(), device="cpu").pin_memory()
                host.copy_(st, non_blocking=True)
            self._held.append((st, host))
            moved += st.nbytes()
        sync()
        for st, _ in self._held:
            st.resize_(0)
        return moved

    def restore(self) -> int:
        """Reallocate every released storage and copy its bytes back; returns the bytes moved."""
        moved = 0
        for st, host in self._held:
            st.resize_(host.nbytes())
            st.copy_(host, non_blocking=True)
            moved += host.nbytes()
        sync()
        self._held.clear()
        return moved


class PhaseTimer:
    """Wall time of named phases, synchronised with the accelerator: `with timer("params"): ...`."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            sync()
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0
