"""SGLang as a cell's engine: ``python -m <engine.sglang_launcher>`` with SGLang's flags, one
server per node of the cell (:mod:`gyre.engine.sglang_launch`), its admin routes
(:mod:`gyre.engine.sglang_api`) and its ``/generate`` wire (:class:`gyre.engine.client.EngineClient`).

It cannot run on the CPU machines here (no CPU build of its kernels on the package index); tests run
the same command lines with ``gyre.engine.sglang_standin``. ``--enable-memory-saver`` (CUDA only) is
passed only when the cell has GPUs (``sched.gpus_per_node`` > 0); without it a role switch pauses
generation instead of freeing memory.
"""

from __future__ import annotations

import sys

from gyre.config import ConfigError
from gyre.engine.backends.base import Backend, Capabilities, resolve_ports
from gyre.engine.client import EngineClient
from gyre.engine.process import EngineHandle
from gyre.engine.sglang_api import SGLangAdmin
from gyre.engine.sglang_launch import SGLangSpec, srun_step
from gyre.model.families import ModelFormatError, family_of, read_config, text_config

ROUTING_FLAG = "--enable-return-routed-experts"


def is_hybrid(model_dir) -> bool:
    """Whether the model directory holds a hybrid (Gated DeltaNet) family; False when it cannot be
    read here (SGLang then reports the directory itself)."""
    try:
        return family_of(text_config(read_config(model_dir))).hybrid
    except ModelFormatError:
        return False


def _cuda(cfg) -> bool:
    return cfg.sched.gpus_per_node > 0


class SGLang(Backend):
    name = "sglang"
    capabilities = Capabilities(
        spans_nodes=True, releases_memory=True, pause_keeps_requests=True, routed_experts=True,
        streaming=True, priority=True, where="GPU nodes with SGLang installed (CUDA); its CPU stand-in in tests",
        notes=("--enable-memory-saver needs CUDA: without GPUs a role switch pauses generation instead "
               "of freeing memory",))
    client_class = EngineClient

    def launch(self, cfg, model_dir, *, api_key, nodes, port, dist_init_port, weight_version, srun, extra_args, env):
        e = cfg.engine
        n = len(nodes)
        ports = resolve_ports(e, nodes, port, dist_init_port, srun,
                              'set engine.host = "0.0.0.0" (the URL then names the cell\'s node 0)')
        local, port, dist_host, dist_init_port = ports.local, ports.port, ports.dist_host, ports.dist_port
        tp = e.tp_size or max(1, cfg.sched.gpus_per_node) * n
        routing = [ROUTING_FLAG] if cfg.train.routing_replay and ROUTING_FLAG not in map(str, e.sglang_args) else []
        spec = SGLangSpec(str(model_dir), host=e.host, port=port, api_key=api_key, tp=tp, nnodes=n,
                          dist_init_addr=f"{dist_host}:{dist_init_port}" if n > 1 else "",
                          weight_version=str(weight_version), launcher=e.sglang_launcher,
                          extra=[str(a) for a in e.sglang_args] + routing,
                          hybrid=is_hybrid(model_dir), memory_saver=_cuda(cfg))
        try:
            commands = ([spec.command(node_rank=r) for r in range(n)] if local
                        else [srun_step(spec, nodes, list(srun))])
        except ValueError as err:
            raise ConfigError(str(err)) from None
        wildcard = e.host in ("0.0.0.0", "::", "")
        url_host = ("127.0.0.1" if local else nodes[0]) if wildcard else e.host
        return EngineHandle.spawn(commands, f"http://{url_host}:{port}", self.name, nodes, api_key, env=env)

    def admin(self, cfg, url, api_key, timeout_s):
        return SGLangAdmin(url, api_key, timeout_s=timeout_s, memory_saver=_cuda(cfg))

    def start_failed(self, cfg, error):
        launcher = cfg.engine.sglang_launcher
        if f"No module named '{launcher.split('.')[0]}'" in error:
            return (f"{error}\n(engine.sglang_launcher = {launcher!r} is not installed for {sys.executable}: "
                    "install SGLang on the GPU nodes, or set it to gyre.engine.sglang_standin to test without GPUs)")
        return None


BACKEND = SGLang()
