"""Issue 34, item 2: the relay from a sandbox to the proxy caps one execution's connections
(7,811 held connections brought the head to EMFILE and lost a sibling's execution)."""

from __future__ import annotations

import asyncio

from gyre.harness.sandbox import ProxyBridge


def test_the_relay_closes_connections_over_its_cap_and_takes_new_ones_when_some_end():
    async def main():
        async def echo(r, w):
            while data := await r.read(100):
                w.write(data)
                await w.drain()
            w.close()

        upstream = await asyncio.start_server(echo, "127.0.0.1", 0)
        port = upstream.sockets[0].getsockname()[1]
        bridge = await ProxyBridge(f"http://127.0.0.1:{port}/v1", max_connections=3).start()
        try:
            async def connect():
                r, w = await asyncio.open_unix_connection(str(bridge.path))
                try:
                    w.write(b"ping")
                    await w.drain()
                    return r, w, await r.read(100)
                except (ConnectionResetError, BrokenPipeError):  # closed by the relay
                    return r, w, b""

            held = [await connect() for _ in range(3)]
            assert [got for _, _, got in held] == [b"ping"] * 3 and bridge.open == 3
            _, w4, got = await connect()
            assert got == b"" and bridge.refused == 1  # closed at once, never relayed
            w4.close()
            held[0][1].close()
            while bridge.open == 3:  # the relay sees the end of the first connection
                await asyncio.sleep(0.01)
            _, w5, got = await connect()
            assert got == b"ping"
            for _, w, _ in held[1:] + [(None, w5, None)]:
                w.close()
        finally:
            await bridge.close()
            upstream.close()

    asyncio.run(asyncio.wait_for(main(), 30))
