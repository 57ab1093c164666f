"""The SGLang launch path cannot run without GPUs; its command line is what we can check."""

import pytest

from gyre.engine.sglang_launch import SGLangSpec


def test_command_has_what_a_cell_needs():
    cmd = SGLangSpec("/models/qwen", port=31000, api_key="k", tp=8).command("python")
    assert cmd[:3] == ["python", "-m", "sglang.launch_server"]
    for flag in ("--skip-tokenizer-init", "--enable-memory-saver"):
        assert flag in cmd
    assert cmd[cmd.index("--tp-size") + 1] == "8" and "--tp" not in cmd and cmd[cmd.index("--port") + 1] == "31000"
    assert cmd[cmd.index("--api-key") + 1] == "k" and "--nnodes" not in cmd


def test_multi_node_cell_needs_an_init_address():
    with pytest.raises(ValueError, match="dist_init_addr"):
        SGLangSpec("/m", nnodes=4).command("python")
    cmd = SGLangSpec("/m", nnodes=4, node_rank=2, dist_init_addr="node01:5000").command("python")
    assert cmd[cmd.index("--node-rank") + 1] == "2" and cmd[cmd.index("--dist-init-addr") + 1] == "node01:5000"
