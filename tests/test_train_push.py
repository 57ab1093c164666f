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
