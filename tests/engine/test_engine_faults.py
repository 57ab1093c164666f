"""An engine process that dies at a named phase (``faults.hit("engine", phase)``, injected with
GYRE_FAULT): the router finishes in-flight work on another engine, or the client gets a clear
retryable error, and the proxy records every call exactly once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from openai import OpenAI

from gyre import faults
from gyre.engine.client import EngineClient, EngineError
from gyre.engine.launch import start_engine
from gyre.engine.router import Router
from gyre.model.tiny import ensure_tiny_model
from gyre.model.tokenizer import load_tokenizer
from gyre.proxy.routes import create_app, start_site
from gyre.proxy.server import Proxy
from support.loop_thread import LoopThread

pytestmark = pytest.mark.slow


class LiveStack:
    """Two embedded engine processes (both armed with the same one-shot fault) behind the real
    router and proxy; whichever engine reaches the phase first dies there."""

    def __init__(self, tiny, phase: str, fault_dir, monkeypatch):
        monkeypatch.setenv("GYRE_FAULT", f"engine:{phase}")
        monkeypatch.setenv("GYRE_FAULT_DIR", str(fault_dir))
        with ThreadPoolExecutor(2) as pool:
            self.engines = list(pool.map(lambda _: start_engine(tiny, extra_args=["--no-api-key"]), range(2)))
        monkeypatch.delenv("GYRE_FAULT")
        self.phase = phase
        self.lt = LoopThread()

        async def up():
            router = Router([e.url for e in self.engines], connect_retries=0)
            proxy = Proxy(router, load_tokenizer(tiny))
            runner, port = await start_site(create_app(proxy, admin_key="a"), "127.0.0.1", 0)
            return router, proxy, runner, port

        self.router, self.proxy, self.runner, port = self.lt.run(up())
        self.key = self.proxy.register("e1")
        self.client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=self.key, max_retries=0, timeout=120)

    def home(self):
        url = self.router.pick("e1")
        return next(e for e in self.engines if e.url == url)

    def dead(self):
        """Engines that exited. The victim named in the fault marker is waited for first: its
        socket closes (the client's error) a moment before the kernel reports it exited."""
        m = faults.marker("engine", self.phase)
        if m.exists():
            pid = int(m.read_text())
            for e in self.engines:
                if e.proc.pid == pid:
                    e.proc.wait(timeout=60)
        return [e for e in self.engines if e.proc.poll() is not None]

    def tree(self):
        return self.proxy.by_id["e1"].tree

    def close(self):
        self.lt.run(self.runner.cleanup())
        self.lt.run(self.router.close())
        self.lt.close()
        for e in self.engines:
            e.stop()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


@pytest.fixture
def live(request, tiny, tmp_path, monkeypatch):
    s = LiveStack(tiny, request.param, tmp_path / "faults", monkeypatch)
    yield s
    s.close()


def fired(live) -> bool:
    m = faults.marker("engine", live.phase)
    return m.exists()


MSGS = [{"role": "user", "content": "hello there"}]


@pytest.mark.parametrize("live", ["generate"], indirect=True)
def test_engine_fault_phase_generate(live):
    r = live.client.chat.completions.create(model="main", messages=MSGS, max_tokens=8)
    assert fired(live) and len(live.dead()) == 1  # the engine that got the call died in it
    assert r.choices[0].message is not None and r.usage.completion_tokens >= 1
    calls = live.tree().calls
    assert len(calls) == 1 and calls[0].endpoint != live.dead()[0].url  # served by the survivor, once
    assert live.proxy.calls_total == 1


@pytest.mark.parametrize("live", ["release"], indirect=True)
def test_engine_fault_phase_release(live):
    live.client.chat.completions.create(model="main", messages=MSGS, max_tokens=4)
    home = live.home()

    async def release():
        async with EngineClient(home.url, connect_retries=0) as c:
            with pytest.raises(EngineError):  # the process died while releasing: no answer
                await c.release_memory(["kv_cache", "weights"])

    live.lt.run(release())
    assert fired(live) and live.dead() == [home]
    # the execution's next call goes to the surviving engine
    msgs = MSGS + [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}]
    live.client.chat.completions.create(model="main", messages=msgs, max_tokens=4)
    calls = live.tree().calls
    assert len(calls) == 2 and calls[1].endpoint != home.url
    # with no live engine left the client gets a clear, retryable 503 and nothing is recorded
    other = next(e for e in live.engines if e is not home)
    live.lt.run(live.router.remove_endpoint(other.url))
    with pytest.raises(openai.InternalServerError) as e:
        live.client.chat.completions.create(model="main", messages=msgs, max_tokens=4)
    assert e.value.status_code == 503 and "retry" in e.value.message
    assert len(live.tree().calls) == 2


@pytest.mark.parametrize("live", ["weight_load"], indirect=True)
def test_engine_fault_phase_weight_load(live, tiny):
    home = live.home()
    # a long greedy stream is running on the home engine when its weight update kills it
    stream = live.client.chat.completions.create(model="main", messages=MSGS, max_tokens=300, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
    it = iter(stream)
    got = []
    for chunk in it:
        got.append(chunk)
        if chunk.choices and chunk.choices[0].delta.content:
            break

    async def update():
        async with EngineClient(home.url, connect_retries=0) as c:
            with pytest.raises(EngineError):
                await c.update_weights_from_disk(str(tiny), "1")

    live.lt.run(update())
    assert fired(live) and live.dead() == [home]
    got += list(it)  # the stream goes on, continued on the other engine
    finish = [c.choices[0].finish_reason for c in got if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1
    calls = live.tree().calls
    assert len(calls) == 1 and calls[0].endpoint != home.url
    out = live.tree().call_output_ids(calls[0]).tolist()
    assert len(out) == got[-1].usage.completion_tokens == calls[0].n_output
