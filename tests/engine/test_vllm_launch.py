"""The vLLM backend's command lines (no server started): the flags token truth and the RL routes
need, one server per node with vLLM's multi-node flags, one Slurm step over the cell's nodes, the
API key kept off the command line, and the settings it refuses."""

from __future__ import annotations

import pytest

from gyre.config import ConfigError, load_config
from gyre.engine.backends.vllm import BACKEND, cpu_build
from gyre.engine.process import srun_step
from gyre.model.tiny import SERVING_HEAD_DIM, ensure_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.getbasetemp() / "tiny-hd32", head_dim=SERVING_HEAD_DIM)


def test_one_server_has_the_token_truth_and_rl_flags(model):
    cfg = load_config(None, ["engine.backend=vllm", "engine.max_running_requests=7",
                             "engine.vllm_args=['--max-num-seqs', '9']"])
    cmd = BACKEND.command(cfg, model, port=31000)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    text = " ".join(cmd)
    assert "--logprobs-mode processed_logprobs" in text and "--enable-scale-out" in text
    assert "--dtype float32" in text and "--port 31000" in text and "--enforce-eager" in text
    assert cmd[-2:] == ["--max-num-seqs", "9"]  # the user's flag comes last: argparse keeps the last
    assert "--nnodes" not in cmd and "--headless" not in cmd
    # the CPU build prefills whole prompts up to the model's context (a seeded call's chunked
    # prefill kills its EngineCore), and honours a --max-model-len the user gives
    assert cpu_build(cfg) and "--no-enable-chunked-prefill --max-num-batched-tokens 32768" in text
    short = load_config(None, ["engine.backend=vllm", "engine.vllm_args=['--max-model-len=4096']"])
    assert "--max-num-batched-tokens 4096" in " ".join(BACKEND.command(short, model, port=31000))


def test_a_cell_over_three_nodes_is_one_server_per_node_in_one_slurm_step(model):
    cfg = load_config(None, ["engine.backend=vllm", "sched.gpus_per_node=4", "engine.host=0.0.0.0",
                             "engine.vllm_python=/opt/vllm/bin/python"])
    assert not cpu_build(cfg)  # a CUDA vLLM: tensor parallel over the cell's GPUs
    cmds = [BACKEND.command(cfg, model, port=31000, nnodes=3, node_rank=r, master="n1", master_port=31100)
            for r in range(3)]
    for r, cmd in enumerate(cmds):
        text = " ".join(cmd)
        assert f"--nnodes 3 --node-rank {r} --master-addr n1 --master-port 31100" in text
        assert "--tensor-parallel-size 12" in text
        assert "--no-enable-chunked-prefill" not in text  # a CUDA generator rewinds: chunks are fine
        assert ("--headless" in cmd) == (r > 0)  # rank 0 serves HTTP
    step = srun_step(cmds, ["n1", "n2", "n3"], ["srun", "--jobid=5", "--overlap"])
    assert step[:3] == ["srun", "--jobid=5", "--overlap"] and "--nodelist=n1,n2,n3" in step
    script = step[-1]
    assert script.index("n1) exec") < script.index("--node-rank 0") < script.index("n2) exec")
    with pytest.raises(ValueError, match="2 node names for 3 command"):
        srun_step(cmds, ["n1", "n2"], ["srun"])


def test_the_cpu_build_serves_a_cell_of_several_nodes_from_its_node_0(model):
    """vLLM's CPU build has no tensor parallelism across nodes: ``--nnodes 3`` over its world of one
    rank is refused at start, so a CPU cell of three nodes runs one server, on node rank 0."""
    cpu = load_config(None, ["engine.backend=vllm"])
    assert cpu_build(cpu) and BACKEND.serving_nodes(cpu, ["n1", "n2", "n3"]) == ["n1"]
    gpu = load_config(None, ["engine.backend=vllm", "sched.gpus_per_node=4", "engine.vllm_python=/opt/vllm/bin/python"])
    assert BACKEND.serving_nodes(gpu, ["n1", "n2", "n3"]) == ["n1", "n2", "n3"]


def test_the_key_goes_through_the_environment_and_bad_settings_are_refused(model, tmp_path, monkeypatch):
    fake = tmp_path / "venv" / "bin" / "python"
    fake.parent.mkdir(parents=True)
    seen = tmp_path / "env.txt"
    fake.write_text(f"#!/bin/sh\nenv > {seen}\nexit 3\n")  # what the server process would be given
    fake.chmod(0o755)
    cfg = load_config(None, ["engine.backend=vllm", f"engine.vllm_python={fake}", "sched.gpus_per_node=0"])
    BACKEND.check(cfg, model)
    handle = BACKEND.launch(cfg, model, api_key="sekret", nodes=["localhost"], port=0, dist_init_port=0,
                            weight_version="0", srun=None, extra_args=[], env={"PYTHONPATH": "/x"})
    try:
        assert handle.procs[0].wait(10) == 3
        assert "sekret" not in " ".join(handle.procs[0].args)
        env = dict(line.split("=", 1) for line in seen.read_text().splitlines() if "=" in line)
        assert env["VLLM_API_KEY"] == "sekret" and env["VLLM_SERVER_DEV_MODE"] == "1"
        assert "PYTHONPATH" not in env and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    finally:
        handle.stop(timeout=2)
    with pytest.raises(ConfigError, match="head size 16"):
        BACKEND.check(cfg, ensure_tiny_model(tmp_path / "tiny16"))
    with pytest.raises(ConfigError, match="real port"):
        BACKEND.launch(cfg, model, api_key=None, nodes=["n1"], port=0, dist_init_port=0, weight_version="0",
                       srun=["srun"], extra_args=[], env={})
    with pytest.raises(ConfigError, match="train.routing_replay"):
        load_config(None, ["engine.backend=vllm", "train.routing_replay=true"])


def test_the_servable_tiny_variant_has_wider_heads_of_the_same_count(model, tmp_path):
    import json

    from gyre.model.tiny import head_dim_of

    conf = json.loads((model / "config.json").read_text())
    assert head_dim_of(conf) == 32 and conf["num_attention_heads"] == 4 and conf["num_key_value_heads"] == 2
    assert json.loads((model / "gyre_identity.json").read_text())["name"].endswith("-hd32")
    with pytest.raises(ValueError, match="head size 32, not 16"):
        ensure_tiny_model(model)  # a complete directory of another head size is refused, not overwritten
    q3 = json.loads((ensure_tiny_model(tmp_path / "q3", "qwen3", head_dim=SERVING_HEAD_DIM) / "config.json").read_text())
    assert q3["head_dim"] == 32 and q3["hidden_size"] == 64  # qwen3 names its head size itself
