"""Gyre's embedded engine as a cell's engine: one ``python -m gyre.engine.cli`` on this machine
(the cell's node 0) whatever the cell's nodes: it does not span nodes. It serves SGLang's RL
subset (``/generate``, the memory and weight routes), so its wire and admin are SGLang's.
"""

from __future__ import annotations

import socket

from gyre.engine.backends.base import Backend, Capabilities
from gyre.engine.client import EngineClient
from gyre.engine.process import EngineHandle, start_engine
from gyre.engine.sglang_api import SGLangAdmin


class Embedded(Backend):
    name = "embedded"
    capabilities = Capabilities(
        spans_nodes=False, releases_memory=True, pause_keeps_requests=True, routed_experts=True,
        streaming=True, priority=True, where="any machine (CPU; numpy/torch model of this repository)",
        notes=("one process on the cell's node 0; it does not span nodes",))
    client_class = EngineClient
    serves_here = True

    def launch(self, cfg, model_dir, *, api_key, nodes, port, dist_init_port, weight_version, srun, extra_args, env):
        e = cfg.engine
        settings = [a for k in ("max_running_requests", "max_new_tokens_cap", "max_body_bytes", "pace")
                    for a in ("--set", f"engine.{k}={getattr(e, k)}")]  # the caller's config, not defaults
        proc = start_engine(model_dir, port=port, api_key=api_key, host=e.host,
                            extra_args=["--weight-version", str(weight_version), *settings, *extra_args],
                            timeout_s=e.startup_timeout_s)
        wildcard = e.host in ("0.0.0.0", "::", "")
        url = proc.url.replace("127.0.0.1", socket.getfqdn()) if wildcard else proc.url
        handle = EngineHandle([proc.proc], url, self.name, nodes[:1], api_key, output=proc.output, on_stop=proc.stop)
        handle.key_file = proc._key_file
        return handle

    def admin(self, cfg, url, api_key, timeout_s):
        return SGLangAdmin(url, api_key, timeout_s=timeout_s)


BACKEND = Embedded()
