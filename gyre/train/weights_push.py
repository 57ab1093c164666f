"""Push new weights to the engine endpoints (SGLang or the embedded engine: same HTTP subset).

Disk path (checked on CPU): the trainer exports to a shared directory, then every endpoint gets
`POST /update_weights_from_disk {model_path, weight_version}`.

Distributed path (clusters; written against SGLang's documented API; here only the protocol is
checked, over gloo against a stand-in for SGLang's side; NCCL with a real SGLang needs GPUs):
`POST /init_weights_update_group {master_address, master_port, rank_offset, world_size,
group_name, backend}` once, while the trainer joins the same NCCL group as rank 0; then per
update `POST /update_weights_from_distributed {names, dtypes, shapes, group_name,
weight_version}` while the trainer broadcasts each tensor in that order.
"""

from __future__ import annotations

import asyncio
import datetime
from dataclasses import dataclass, field
from typing import Sequence

import aiohttp
import torch
from torch import Tensor


class WeightPushError(RuntimeError):
    """An endpoint refused or failed a weight update."""


def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def _post(session: aiohttp.ClientSession, url: str, path: str, body: dict,
                api_key: str | None) -> dict:
    async with session.post(url.rstrip("/") + path, json=body, headers=_headers(api_key)) as resp:
        text = await resp.text()
        if resp.status != 200:
            raise WeightPushError(f"{url}{path}: HTTP {resp.status}: {text[:500]}")
        try:
            data = await resp.json(content_type=None)
        except ValueError:
            data = {"raw": text}
        if isinstance(data, dict) and data.get("success") is False:
            raise WeightPushError(f"{url}{path}: {data.get('message', data)}")
        return data if isinstance(data, dict) else {"result": data}


async def _post_all(urls: Sequence[str], path: str, body: dict, api_key: str | None,
                    timeout_s: float) -> dict[str, dict]:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        results = await asyncio.gather(*(_post(session, u, path, body, api_key) for u in urls),
                                       return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise WeightPushError("; ".join(map(str, errors))) from errors[0]
    return dict(zip(urls, results))


async def push_from_disk(urls: Sequence[str], model_path: str, weight_version: int | str, *,
                         api_key: str | None = None, timeout_s: float = 600.0) -> dict[str, dict]:
    """Every endpoint loads `model_path` (a directory from `Trainer.export_weights`)."""
    body = {"model_path": str(model_path), "weight_version": str(weight_version)}
    return await _post_all(urls, "/update_weights_from_disk", body, api_key, timeout_s)


# --- distributed fast path (GPU clusters only) ------------------------------------------------

def init_custom_process_group(master_address: str, master_port: int, rank: int, world_size: int,
                              group_name: str, backend: str = "nccl",
                              timeout: datetime.timedelta = datetime.timedelta(minutes=10)):
    """A process group outside the default world, built the way SGLang builds its side of it
    (rendezvous on a TCP store, prefixed by the group name), so both ends meet."""
    from torch.distributed.distributed_c10d import (PrefixStore, _new_process_group_helper,
                                                    _world, rendezvous)

    url = f"tcp://{master_address}:{master_port}"
    store, rank, world_size = next(rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(world_size, rank, [], backend, PrefixStore(group_name, store),
                                      group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


@dataclass
class DistributedPusher:
    """Trainer side (rank 0) of SGLang's weight-update group. One instance per training job.

    The group has 1 + sum(engine_tp_sizes) ranks; engine i gets `rank_offset` 1 + the ranks of
    the engines before it. `backend` is nccl on clusters (gloo only for the CPU protocol test).
    """

    urls: Sequence[str]
    engine_tp_sizes: Sequence[int]
    master_address: str
    master_port: int
    group_name: str = "gyre_weights"
    api_key: str | None = None
    timeout_s: float = 600.0
    backend: str = "nccl"
    _group: object = field(default=None, init=False, repr=False)

    async def init_group(self) -> None:
        world = 1 + sum(self.engine_tp_sizes)
        offsets = [1 + sum(self.engine_tp_sizes[:i]) for i in range(len(self.urls))]
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            posts = [asyncio.create_task(_post(session, url, "/init_weights_update_group", {
                "master_address": self.master_address, "master_port": self.master_port,
                "rank_offset": off, "world_size": world, "group_name": self.group_name,
                "backend": self.backend}, self.api_key)) for url, off in zip(self.urls, offsets)]
            # the engines block in the rendezvous until we join it too
            self._group = await asyncio.to_thread(
                init_custom_process_group, self.master_address, self.master_port, 0, world,
                self.group_name, self.backend)
            await asyncio.gather(*posts)

    async def push(self, named: Sequence[tuple[str, Tensor]], weight_version: int | str) -> None:
        """Broadcast tensors (transformers names; CUDA for nccl) while every engine receives them."""
        if self._group is None:
            raise RuntimeError("call init_group() first")
        body = {"names": [n for n, _ in named],
                "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
                "shapes": [list(t.shape) for _, t in named],
                "group_name": self.group_name, "weight_version": str(weight_version),
                "flush_cache": True}

        def broadcast() -> None:
            for _, t in named:
                torch.distributed.broadcast(t.contiguous(), group=self._group, group_src=0)
            if torch.cuda.is_available():
                torch.cuda.synchronize()

        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            posts = [asyncio.create_task(_post(session, url, "/update_weights_from_distributed",
                                               body, self.api_key)) for url in self.urls]
            await asyncio.to_thread(broadcast)
            await asyncio.gather(*posts)
