"""The engine backends sit behind one table: every `engine.backend` choice is a module of
gyre/engine/backends/ with its BACKEND, every module there is a backend (or a helper named after
one), and the code that starts, drives and routes to engines never names a backend."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gyre.config import ConfigError, EngineBackend, load_config
from gyre.engine import backends
from gyre.engine.backends.base import Backend, Capabilities, EngineAdmin
from gyre.engine.client import EngineClient

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gyre" / "engine" / "backends"
# the code that must stay backend-neutral: the seam, the process machinery, the cell's engine,
# the router, `gyre engine`, the rollout service
NEUTRAL = ["gyre/engine/launch.py", "gyre/engine/process.py", "gyre/cell/engine.py", "gyre/cell/agent.py",
           "gyre/engine/router.py", "gyre/engine/cli.py", "gyre/services/rollout.py", "gyre/offline_rollout.py"]


def test_every_choice_is_a_backend_module_and_every_module_a_choice():
    names = {b.value for b in EngineBackend}
    assert set(backends.NAMES) == names
    for name in names:
        b = backends.get(name)
        assert isinstance(b, Backend) and b.name == name
        assert isinstance(b.capabilities, Capabilities) and b.capabilities.where
        assert issubclass(b.client_class, EngineClient)
        for method in ("launch", "admin"):  # each backend fills the contract itself
            assert getattr(type(b), method) is not getattr(Backend, method), (name, method)
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__", "base"}
    for m in modules:
        assert m in names or m.split("_")[0] in names, f"gyre/engine/backends/{m}.py is neither a backend nor a helper of one"


def test_an_unknown_backend_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="choose one of embedded, sglang, vllm"):
        backends.get("tgi")
    with pytest.raises(ConfigError, match="engine.backend"):
        load_config(None, ["engine.backend=tgi"])


@pytest.mark.parametrize("path", NEUTRAL)
def test_the_launcher_cell_and_router_never_name_a_backend(path):
    text = (ROOT / path).read_text(encoding="utf-8")
    code = re.sub(r'""".*?"""', "", text, flags=re.S)  # docstrings may explain; code may not branch
    code = "\n".join(line.split("#")[0] for line in code.splitlines())
    assert not re.search(r"EngineBackend\.|SGLangAdmin|sglang_api|sglang_launch|backends\.(sglang|vllm|embedded)",
                         code), path
    assert not re.search(r"""["'](embedded|sglang|vllm)["']""", code), path


def test_every_admin_fills_the_cell_contract():
    cfg = load_config(None, [])
    for name in backends.NAMES:
        admin = backends.get(name).admin(cfg, "http://127.0.0.1:9", None, 1.0)
        for method in ("abort_all", "release_memory", "resume_memory", "load_weights", "weight_version", "healthy"):
            assert getattr(type(admin), method) is not getattr(EngineAdmin, method), (name, method)
        assert admin.healthy(timeout_s=0.2) is False  # nothing listens on port 9: an answer, not a hang
