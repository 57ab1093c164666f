"""The embedded engine and its HTTP server on a background thread of the test process (tests
that need an engine without a subprocess; production starts engines through gyre.engine.launch)."""

from __future__ import annotations

import asyncio
import os
import threading

from gyre.engine.runtime import Engine
from gyre.engine.server import EngineServer


class InProcessEngine:
    """An :class:`~gyre.engine.runtime.Engine` and its HTTP server on a background thread."""

    def __init__(self, model_dir: str | os.PathLike, api_key: str | None = None, host: str = "127.0.0.1",
                 port: int = 0, **engine_kwargs):
        self.engine = Engine(model_dir, **engine_kwargs)
        self._loop = asyncio.new_event_loop()
        self._server = EngineServer(self.engine, host, port, api_key)
        self._thread = threading.Thread(target=self._loop.run_forever, name="gyre-engine-http", daemon=True)
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._server.start(), self._loop).result(30)

    def stop(self) -> None:
        if not self._loop.is_closed():
            asyncio.run_coroutine_threadsafe(self._server.close(), self._loop).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()
            self.engine.close()

    def __enter__(self) -> "InProcessEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
