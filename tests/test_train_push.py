"""Weight push to engine endpoints over HTTP (the disk path; the NCCL path needs GPUs)."""

import asyncio

import pytest
from aiohttp import web

from gyre.train.weights_push import WeightPushError, push_from_disk


async def _serve(handler):
    app = web.Application()
    app.router.add_post("/update_weights_from_disk", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def test_push_from_disk_reaches_every_endpoint_with_auth():
    seen = []

    async def ok(request):
        seen.append((request.headers.get("Authorization"), await request.json()))
        return web.json_response({"success": True, "message": "loaded"})

    async def refuse(request):
        return web.json_response({"success": False, "message": "bad path"})

    async def main():
        r1, u1 = await _serve(ok)
        r2, u2 = await _serve(ok)
        r3, u3 = await _serve(refuse)
        try:
            res = await push_from_disk([u1, u2], "/shared/w/7", 7, api_key="sekrit")
            assert set(res) == {u1, u2}
            with pytest.raises(WeightPushError, match="bad path"):
                await push_from_disk([u1, u3], "/shared/w/8", 8)
        finally:
            for r in (r1, r2, r3):
                await r.cleanup()

    asyncio.run(main())
    body = {"model_path": "/shared/w/7", "weight_version": "7"}
    assert seen[:2] == [("Bearer sekrit", body)] * 2
    assert seen[2] == (None, {"model_path": "/shared/w/8", "weight_version": "8"})


def _fake_sglang(port_q, got_q):
    """SGLang's side of the weight-update group, as its docs describe it, over gloo on the CPU."""
    import torch
    from aiohttp import web

    from gyre.train.weights_push import init_custom_process_group

    group = {}

    async def init(request):
        b = await request.json()
        group["pg"] = await asyncio.to_thread(
            init_custom_process_group, b["master_address"], b["master_port"], b["rank_offset"],
            b["world_size"], b["group_name"], b["backend"])
        return web.json_response({"success": True, "message": "joined"})

    async def update(request):
        b = await request.json()

        def receive():
            out = {}
            for name, dtype, shape in zip(b["names"], b["dtypes"], b["shapes"]):
                t = torch.empty(shape, dtype=getattr(torch, dtype))
                torch.distributed.broadcast(t, group=group["pg"], group_src=0)
                out[name] = (str(t.dtype), t.float().numpy())  # numpy has no bfloat16
            return out

        got_q.put((b["weight_version"], b["group_name"], await asyncio.to_thread(receive)))
        return web.json_response({"success": True, "message": "updated"})

    async def main():
        app = web.Application()
        app.router.add_post("/init_weights_update_group", init)
        app.router.add_post("/update_weights_from_distributed", update)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port_q.put(site._server.sockets[0].getsockname()[1])
        await asyncio.sleep(60)

    asyncio.run(main())


def test_distributed_push_protocol_over_gloo():
    """The trainer side of update_weights_from_distributed against a stand-in for SGLang's side
    (the real fast path is NCCL between GPUs and is checked only there)."""
    import socket

    import torch
    import torch.multiprocessing as mp

    from gyre.train.weights_push import DistributedPusher

    ctx = mp.get_context("spawn")
    port_q, got_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_fake_sglang, args=(port_q, got_q), daemon=True)
    proc.start()
    try:
        url = f"http://127.0.0.1:{port_q.get(timeout=60)}"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            master_port = s.getsockname()[1]
        pusher = DistributedPusher([url], [1], "127.0.0.1", master_port, backend="gloo")
        named = [("model.norm.weight", torch.arange(4.0)),
                 ("lm_head.weight", torch.randn(3, 5).to(torch.bfloat16))]

        async def run():
            await pusher.init_group()
            await pusher.push(named, weight_version=9)

        asyncio.run(run())
        version, group_name, got = got_q.get(timeout=60)
    finally:
        proc.kill()
    assert (version, group_name) == ("9", "gyre_weights")
    assert list(got) == ["model.norm.weight", "lm_head.weight"]
    for name, t in named:
        dtype, values = got[name]
        assert dtype == str(t.dtype) and torch.equal(torch.from_numpy(values), t.float())
