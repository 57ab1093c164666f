"""A proxy in front of a scripted engine, for the proxy tests: its renderer, tools and an HTTP helper."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

from openai import OpenAI
from tokenizers import Tokenizer

from gyre.engine.router import Router
from gyre.proxy.capture import Renderer
from gyre.proxy.routes import create_app, start_site
from gyre.proxy.server import Proxy
from support.loop_thread import LoopThread
from support.scripted_engine import ScriptedEngine


TOKENIZER = Tokenizer.from_file(str(Path(__file__).parents[2] / "gyre" / "assets" / "tokenizer.json"))
R = Renderer(TOKENIZER)
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a shell command",
                                           "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]


class Stack:
    def __init__(self, max_body: int = 64 * 1024):
        self.lt = LoopThread()
        self.engine = ScriptedEngine(decode=R.decode)
        self.engine.script = [R.encode("Hello from the model.") + [R.im_end]]

        async def up():
            self.erunner, eport = await start_site(self.engine.app(), "127.0.0.1", 0)
            self.router = Router([f"http://127.0.0.1:{eport}"])
            self.proxy = Proxy(self.router, TOKENIZER)
            app = create_app(self.proxy, admin_key="admin-secret", max_body_bytes=max_body)
            self.prunner, self.port = await start_site(app, "127.0.0.1", 0)

        self.lt.run(up())
        self.base = f"http://127.0.0.1:{self.port}"

    def client(self, execution_id: str = "e1", **kw) -> tuple[OpenAI, str]:
        key = self.proxy.register(execution_id, task="t", group=0)
        return OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0, **kw), key

    def tree(self, execution_id: str = "e1"):
        return self.proxy.by_id[execution_id].tree

    def close(self):
        async def down():
            await self.prunner.cleanup()
            await self.router.close()
            await self.erunner.cleanup()
        self.lt.run(down())
        self.lt.close()


def post(url: str, data: bytes, key: str | None, ctype: str = "application/json") -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": ctype})
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
