"""What an engine backend is: the contract every module of :mod:`gyre.engine.backends` fills.

A backend says how to start its servers for one cell (:meth:`Backend.launch`), how to talk to a
running one for generation (:attr:`Backend.client_class`, an async :class:`EngineClient`) and for
administration (:meth:`Backend.admin`, a synchronous :class:`EngineAdmin`), and what it can and
cannot do (:class:`Capabilities`). Gyre's launcher, cell agent and router ask the table
(:func:`gyre.engine.backends.get`) for these and never name a backend themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from gyre.config import ConfigError
from gyre.engine.process import free_port


class EngineAdminError(RuntimeError):
    """An admin route answered non-2xx (``status``) or could not be reached (``status`` None)."""

    def __init__(self, status: int | None, message: str, route: str):
        super().__init__(f"{route}: {status or 'unreachable'}: {message}")
        self.status, self.message, self.route = status, message, route


@dataclass(frozen=True)
class Capabilities:
    """What a backend does (for the docs, the config checks and the cell agent's choices)."""

    spans_nodes: bool           # one engine over several nodes (tensor parallel across them)
    releases_memory: bool       # a role switch frees the engine's accelerator memory
    pause_keeps_requests: bool  # a weight push holds running calls and resumes them (never aborts)
    routed_experts: bool        # returns MoE routed experts (train.routing_replay)
    streaming: bool = True      # token-by-token generation the router passes through
    priority: bool = False      # honours the proxy's per-call priority
    where: str = ""             # the machines it runs on
    notes: tuple[str, ...] = field(default_factory=tuple)  # what it cannot do, in words


class EngineAdmin:
    """A running engine's admin calls, as the cell agent makes them (synchronous: admin calls are
    rare and the cell agent is a synchronous loop). Each backend implements these over its own
    documented routes."""

    def abort_all(self) -> None:
        raise NotImplementedError

    def release_memory(self) -> None:
        """Free the engine's memory for the trainer (a role switch); raise
        :class:`EngineAdminError` while requests still run (the caller retries)."""
        raise NotImplementedError

    def resume_memory(self) -> None:
        raise NotImplementedError

    def load_weights(self, weights_dir: str, version: str) -> None:
        """Serve the weights in ``weights_dir`` as ``version``; calls that run meanwhile are never
        aborted, and the prefix cache holds nothing of the old weights afterwards."""
        raise NotImplementedError

    def weight_version(self) -> str:
        raise NotImplementedError

    def healthy(self, timeout_s: float = 5.0) -> bool:
        raise NotImplementedError


class Backend:
    """One engine backend (a module of this package defines ``BACKEND = <subclass>()``)."""

    name: str = ""
    capabilities: Capabilities
    client_class: type  # an async gyre.engine.client.EngineClient (sub)class speaking its wire
    serves_here: bool = False  # `gyre engine` serves in its own process (else it starts servers and waits)

    def check(self, cfg, model_dir) -> None:
        """Refuse settings this backend cannot serve (``ConfigError`` with the reason and the fix)."""

    def launch(self, cfg, model_dir, *, api_key: str | None, nodes: Sequence[str], port: int,
               dist_init_port: int, weight_version: str, srun: Sequence[str] | None,
               extra_args: Sequence[str], env: dict | None):
        """Start the cell's servers without waiting: an :class:`gyre.engine.launch.EngineHandle`."""
        raise NotImplementedError

    def admin(self, cfg, url: str, api_key: str | None, timeout_s: float) -> EngineAdmin:
        raise NotImplementedError

    def ready(self, cfg, handle, api_key: str | None, weight_version: str) -> None:
        """Once ``/health`` answers: whatever the server needs before it serves Gyre (e.g. the
        weight version it reports)."""

    def start_failed(self, cfg, error: str) -> str | None:
        """A clearer message for a start that failed with ``error`` (e.g. the server is not
        installed), or None to keep it."""
        return None


@dataclass(frozen=True)
class Ports:
    """Where a multi-process engine listens and rendezvouses, as every server backend resolves it."""
    local: bool          # every node rank a process on this machine (no srun step)
    port: int            # node rank 0's HTTP port
    dist_host: str       # where the node ranks meet
    dist_port: int       # 0 with one node


def resolve_ports(e, nodes: Sequence[str], port: int, dist_init_port: int, srun, host_fix: str) -> Ports:
    """A free port locally (0 = any), a real one under srun; an engine on the cell's nodes must be
    reachable from the head (``host_fix`` says how, per backend)."""
    local = srun is None
    if local and not port:
        port = free_port()
    if not port:
        raise ConfigError("engine.port: a cell engine launched through srun needs a real port (not 0)")
    if not local and e.host in ("127.0.0.1", "localhost", "::1"):
        raise ConfigError(f"engine.host {e.host}: an engine launched on the cell's nodes must be reachable from "
                          f"the head; {host_fix}")
    if len(nodes) > 1 and not dist_init_port:
        dist_init_port = free_port() if local else port + 100
    return Ports(local, port, "127.0.0.1" if local else nodes[0], dist_init_port)
