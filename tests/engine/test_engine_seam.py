"""The engine seam: one function starts a cell's engine, embedded or SGLang (here SGLang's stand-in,
same command line), and every admin call goes through SGLang's documented routes."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from gyre.config import ConfigError, load_config
from gyre.engine.launch import EngineStartError, start_cell_engine
from gyre.engine.sglang_api import SGLangAdmin, SGLangAPIError
from gyre.engine.sglang_standin import StandinUsageError, parse_args
from gyre.model.checksums import write_checksums
from gyre.model.tiny import ensure_tiny_model

KEY = "seam-key"
PROMPT = [1, 882, 198, 40, 1000, 2000, 17, 198]
STANDIN = ["engine.backend=sglang", "engine.sglang_launcher=gyre.engine.sglang_standin",
           "engine.startup_timeout_s=120"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.getbasetemp() / "tiny-qwen")


@pytest.fixture(scope="module")
def standin(tiny):
    cfg = load_config(None, STANDIN)
    with start_cell_engine(cfg, tiny, api_key=KEY, weight_version="3") as handle:
        yield handle


def _long_generation(url: str, rid: str) -> tuple[threading.Thread, dict]:
    """A 4000-token greedy generation running in a thread; its response lands in the dict."""
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(_generate(url, rid=rid, max_new_tokens=4000, ignore_eos=True)))
    t.start()
    return t, result


def _generate(url: str, rid: str | None = None, max_new_tokens: int = 8, ignore_eos: bool = False) -> dict:
    body = {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": ignore_eos}}
    if rid:
        body["rid"] = rid
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def test_seam_starts_the_embedded_engine(tiny):
    cfg = load_config(None, ["engine.startup_timeout_s=120"])
    with start_cell_engine(cfg, tiny, api_key=KEY, nodes=["n0", "n1"], weight_version="5") as h:
        assert h.backend == "embedded" and h.alive() and h.nodes == ["n0"]  # embedded: node 0 only
        assert len(h.pids) == 1 and h.procs[0].pid == h.pids[0]
        admin = SGLangAdmin(h.url, KEY)
        assert admin.healthy() and admin.weight_version() == "5"
        with pytest.raises(SGLangAPIError) as err:  # /health needs no key in SGLang; other routes do
            SGLangAdmin(h.url, "wrong").weight_version()
        assert err.value.status == 401
    assert not h.alive() and h.procs[0].poll() is not None
    h.stop()  # idempotent


def test_seam_starts_sglang_through_the_standin_with_sglang_flags(standin, tiny):
    assert standin.backend == "sglang" and standin.alive() and len(standin.pids) == 1
    admin = SGLangAdmin(standin.url, KEY)
    assert admin.healthy() and admin.weight_version() == "3"
    with pytest.raises(SGLangAPIError) as err:
        SGLangAdmin(standin.url, "wrong").weight_version()
    assert err.value.status == 401


def test_release_resume_and_weight_load_through_sglangs_routes(standin, tiny, tmp_path):
    admin = SGLangAdmin(standin.url, KEY)
    before = _generate(standin.url)["output_ids"]
    admin.release_memory_occupation()          # tags kv_cache + weights, as a role switch does
    with pytest.raises(urllib.error.HTTPError) as refused:
        _generate(standin.url)                 # nothing is served while memory is released
    assert refused.value.code == 503
    admin.resume_memory_occupation()
    # New weights from a directory (what an export writes): outputs change, the version follows.
    new = tmp_path / "step1"
    shutil.copytree(tiny, new)
    tensors = load_file(new / "model.safetensors")
    tensors = {k: (v * 1.5 if k.endswith("q_proj.weight") or k.startswith("lm_head") else v) for k, v in tensors.items()}
    save_file(tensors, new / "model.safetensors")
    (new / "gyre_identity.json").unlink(missing_ok=True)
    write_checksums(new)  # as an export does: the engine requires it
    answer = admin.update_weights_from_disk(str(new), "4")
    assert answer["success"] is True and admin.weight_version() == "4"
    after = _generate(standin.url)
    assert after["meta_info"]["weight_version"] == "4" and after["output_ids"] != before
    with pytest.raises(SGLangAPIError) as bad:
        admin.update_weights_from_disk(str(tmp_path / "missing"), "5")
    assert bad.value.status == 400 and admin.weight_version() == "4"
    admin.update_weights_from_disk(str(tiny), "3")  # leave the module's engine as it was
    admin.flush_cache()


def test_abort_request_ends_a_running_generation(standin):
    admin = SGLangAdmin(standin.url, KEY)
    t, result = _long_generation(standin.url, "long-one")
    while t.is_alive():  # abort until the request has been seen (an unknown rid is a no-op in SGLang)
        admin.abort_request(rid="long-one")
        t.join(0.05)
    meta = result["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 4000
    admin.abort_request(abort_all=True)        # nothing running: still a 200
    with pytest.raises(ValueError, match="rid or abort_all"):
        admin.abort_request()


def test_unknown_and_unmodelled_flags_are_refused(tiny):
    with pytest.raises(StandinUsageError, match="unknown flag --no-such-flag"):
        parse_args(["--model-path", str(tiny), "--no-such-flag"])
    with pytest.raises(StandinUsageError, match="--enable-lora is a flag of sglang.launch_server 0.5.23"):
        parse_args(["--model-path", str(tiny), "--enable-lora"])
    with pytest.raises(StandinUsageError, match="ambiguous flag --enable"):
        parse_args(["--model-path", str(tiny), "--enable"])
    args = parse_args(["--model", str(tiny), "--tp", "2", "--mem-fraction-static=0.7"])  # prefixes as SGLang
    assert args.tp_size == 2 and args.port == 30000 and args.weight_version == "default"
    # Through the seam: the launcher exits with the message, the seam names it.
    cfg = load_config(None, STANDIN + ["engine.sglang_args=['--no-such-flag']"])
    with pytest.raises(EngineStartError, match="unknown flag --no-such-flag"):
        start_cell_engine(cfg, tiny, api_key=KEY)
    with pytest.raises(ConfigError, match="multiple of the cell's 2 node"):
        start_cell_engine(load_config(None, STANDIN + ["engine.tp_size=3"]), tiny, api_key=KEY, nodes=["a", "b"])


@pytest.mark.slow
def test_two_node_ranks_serve_together_and_fail_together(tiny):
    cfg = load_config(None, STANDIN)
    with start_cell_engine(cfg, tiny, api_key=KEY, nodes=["node-a", "node-b"]) as h:
        assert len(h.pids) == 2 and h.alive() and h.nodes == ["node-a", "node-b"]
        assert "node rank 1 joined (2/2)" in h.tail(50)  # rank 0 served only once rank 1 had joined
        assert _generate(h.url)["output_ids"]
        SGLangAdmin(h.url, KEY).release_memory_occupation()
        SGLangAdmin(h.url, KEY).resume_memory_occupation()
        h.procs[1].kill()                        # a node of the cell dies: the engine is dead
        assert h.procs[0].wait(30) == 1 and not h.alive()
    # the other way round: rank 1 exits by itself (code 0) when rank 0 goes; stop() ends every rank
    with start_cell_engine(cfg, tiny, api_key=KEY, nodes=["node-a", "node-b"]) as h2:
        h2.procs[0].terminate()
        assert h2.procs[1].wait(120) == 0 and h2.procs[0].wait(120) == 0
    assert all(p.poll() is not None for p in h2.procs) and not h2.alive()


def _child_commands(parent: int | None = None) -> list[str]:
    """Command lines of a process's children (from /proc: what really runs)."""
    parent = os.getpid() if parent is None else parent
    return [Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            for pid in filter(str.isdigit, os.listdir("/proc")) if _ppid(pid) == parent]


@pytest.mark.slow
def test_gyre_rollout_serves_through_sglang_when_the_backend_says_so(tmp_path):
    from gyre.offline_rollout import Rollout

    agent = '["{python}", "-m", "gyre.harness.reference_agent", "--max-tokens", "16", "--max-turns", "2"]'
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", "engine.endpoints=1", "harness.group_size=1",
                             'harness.tasks=["fizzbuzz"]', f"harness.command={agent}", "harness.timeout_s=120",
                             "eval.timeout_s=60", *STANDIN])
    ro = Rollout(cfg, progress=False)
    seen: list[str] = []

    before = set(_child_commands())  # e.g. the module's own stand-in

    async def main():
        task = asyncio.create_task(ro.run())
        await ro.started.wait()
        seen.extend(c for c in _child_commands() if c not in before)
        return await task

    summary = asyncio.run(main())
    assert summary.executions == {"done": 1} and summary.calls > 0
    engines = [c for c in seen if "-m gyre.engine." in c]
    assert len(engines) == 1 and "-m gyre.engine.sglang_standin --model-path" in engines[0], seen
    assert "--skip-tokenizer-init --enable-memory-saver" in engines[0]


@pytest.mark.slow
def test_gyre_engine_starts_sglang_through_the_seam(tiny):
    from gyre.engine.launch import start_engine  # runs `python -m gyre.engine.cli`, waits for its ready line

    sets = [a for o in STANDIN for a in ("--set", o)]
    with start_engine(tiny, api_key=KEY, extra_args=[*sets, "--weight-version", "9"]) as cli:
        cmds = _child_commands(cli.proc.pid)
        assert len(cmds) == 1 and "-m gyre.engine.sglang_standin" in cmds[0] and "--weight-version 9" in cmds[0]
        assert SGLangAdmin(cli.url, KEY).weight_version() == "9"
        cli.stop(timeout=60)  # SIGTERM; generous: on a loaded 2-core machine two processes shut down
    assert cli.proc.returncode == 0  # SIGTERM: the engine was stopped through its handle


def _ppid(pid) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def test_a_missing_launcher_says_how_to_fix_it(tiny):
    cfg = load_config(None, STANDIN + ["engine.sglang_launcher=gyre_missing_pkg.launch_server"])
    with pytest.raises(EngineStartError, match="install SGLang on the GPU nodes, or set it to gyre.engine.sglang_standin"):
        start_cell_engine(cfg, tiny, api_key=KEY)
