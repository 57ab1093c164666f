"""The engine backends, one module per backend, and THE table that finds them.

``engine.backend`` (its choices are ``gyre.config.EngineBackend``) names a module of this package:
``embedded`` (Gyre's own engine), ``sglang`` (SGLang's server, or its CPU stand-in), ``vllm``
(vLLM's OpenAI server with its RL routes). Each module defines ``BACKEND``, a
:class:`~gyre.engine.backends.base.Backend`: its launch command line, readiness, generate wire
(the router's client), admin calls (pause/resume, weight load, prefix-cache reset, memory release
or its absence) and :class:`~gyre.engine.backends.base.Capabilities`.

Adding a backend is its module here plus its name in the config's choice list; the launcher, the
cell agent and the router ask :func:`get` and never name one (tests/engine/test_backends_table.py
checks both). Modules are imported by name on first use, so a backend's dependencies load only
where it runs.
"""

from __future__ import annotations

import importlib

from gyre.config import EngineBackend
from gyre.engine.backends.base import Backend, Capabilities, EngineAdmin, EngineAdminError

__all__ = ["Backend", "Capabilities", "EngineAdmin", "EngineAdminError", "NAMES", "get"]

NAMES: tuple[str, ...] = tuple(b.value for b in EngineBackend)


def get(name) -> Backend:
    """The backend called ``name`` (an ``engine.backend`` value)."""
    name = str(getattr(name, "value", name))
    if name not in NAMES:
        raise ValueError(f"engine.backend {name!r}: choose one of {', '.join(NAMES)}")
    backend = importlib.import_module(f"{__name__}.{name}").BACKEND
    if backend.name != name:
        raise RuntimeError(f"{__name__}.{name} defines the backend {backend.name!r}, not {name!r}")
    return backend
