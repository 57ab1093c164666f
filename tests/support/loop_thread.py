"""Run asyncio servers (proxy, scripted engine) on a background loop while a test drives them
with blocking clients (the real `openai` client, urllib)."""

from __future__ import annotations

import asyncio
import threading


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


class ServedApp:
    """An aiohttp app served on loopback from its own background loop; `with` starts and stops it.

    Subclasses build the app in `routes(app)` and get `self.url` (`http://127.0.0.1:PORT/v1`).
    """

    def routes(self, app) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def __enter__(self):
        from aiohttp import web

        from gyre.proxy.routes import start_site

        self._lt = LoopThread()
        app = web.Application()
        self.routes(app)
        self.runner, port = self._lt.run(start_site(app, "127.0.0.1", 0), timeout=10)
        self.url = f"http://127.0.0.1:{port}/v1"
        return self

    def __exit__(self, *exc):
        self._lt.run(self.runner.cleanup(), timeout=10)
        self._lt.close()
