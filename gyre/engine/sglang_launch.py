"""Start a real SGLang server as a cell's engine (GPU nodes). Written against SGLang's documented
launch options (`python -m sglang.launch_server --help`, 0.5.x); it cannot run on CPU machines,
so only the command line is tested here.

What a Gyre cell needs from it:
- ``--skip-tokenizer-init``: the proxy sends ``input_ids`` and reads ``output_ids`` (token truth);
- ``--enable-memory-saver``: `/release_memory_occupation` and `/resume_memory_occupation` for
  role switches (released weights are freed, so the cell agent pushes weights after a resume);
- ``--tp`` over the cell's GPUs, and ``--nnodes/--node-rank/--dist-init-addr`` when a cell spans
  several nodes (one server process per node, rank 0 serves HTTP);
- ``--api-key``: the job's engine secret (SGLang takes it only on the command line; on a shared
  cluster prefer nodes that are allocated exclusively, since `ps` shows arguments).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from gyre.engine.launch import EngineProcess, EngineStartError


@dataclass
class SGLangSpec:
    model_path: str
    host: str = "0.0.0.0"
    port: int = 30000
    api_key: str | None = None
    tp: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str = ""          # host:port of node 0 of the cell, when nnodes > 1
    mem_fraction_static: float | None = None
    weight_version: str = "0"
    extra: list[str] = field(default_factory=list)

    def command(self, python: str = sys.executable) -> list[str]:
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("a cell spanning several nodes needs dist_init_addr (node 0's host:port)")
        cmd = [python, "-m", "sglang.launch_server", "--model-path", self.model_path,
               "--host", self.host, "--port", str(self.port), "--tp", str(self.tp),
               "--skip-tokenizer-init", "--enable-memory-saver", "--weight-version", self.weight_version]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        if self.nnodes > 1:
            cmd += ["--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank),
                    "--dist-init-addr", self.dist_init_addr]
        if self.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", str(self.mem_fraction_static)]
        return cmd + list(self.extra)


def start_sglang(spec: SGLangSpec, timeout_s: float = 1800.0, env: dict | None = None) -> EngineProcess:
    """Start the server and wait until GET /health answers (large models load for minutes)."""
    proc = subprocess.Popen(spec.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, env=env or dict(os.environ))
    host = "127.0.0.1" if spec.host in ("0.0.0.0", "::") else spec.host
    url = f"http://{host}:{spec.port}"
    deadline = time.monotonic() + timeout_s
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise EngineStartError(f"sglang exited with {proc.returncode} while starting: {' '.join(spec.command()[:6])} ...")
        try:
            with urllib.request.urlopen(urllib.request.Request(url + "/health", headers=headers), timeout=5) as r:
                if r.status == 200:
                    return EngineProcess(proc, url, None)
        except OSError:
            time.sleep(2.0)
    proc.kill()
    raise EngineStartError(f"sglang did not answer /health at {url} within {timeout_s:.0f} s")


def model_dir_ok(path: str | os.PathLike) -> bool:
    p = Path(path)
    return (p / "config.json").is_file() and any(p.glob("*.safetensors"))
