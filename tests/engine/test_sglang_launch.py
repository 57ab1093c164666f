"""SGLang's command lines (one server per node of a cell), checked against SGLang 0.5.23's flag list."""

import subprocess

import pytest

from gyre.engine.sglang_flags import LAUNCH_SERVER_FLAGS
from gyre.engine.sglang_launch import SGLangSpec, srun_step


def _flags(cmd):
    return [a for a in cmd if a.startswith("--")]


def test_command_has_what_a_cell_needs():
    cmd = SGLangSpec("/models/qwen", port=31000, api_key="k", tp=8).command("python")
    assert cmd[:3] == ["python", "-m", "sglang.launch_server"]
    for flag in ("--skip-tokenizer-init", "--enable-memory-saver"):
        assert flag in cmd
    assert cmd[cmd.index("--tp-size") + 1] == "8" and "--tp" not in cmd
    assert cmd[cmd.index("--port") + 1] == "31000"
    assert cmd[cmd.index("--api-key") + 1] == "k" and "--nnodes" not in cmd


def test_every_flag_is_one_of_sglangs_own():
    spec = SGLangSpec("/m", tp=16, nnodes=2, dist_init_addr="n1:5000", api_key="k", mem_fraction_static=0.8)
    unknown = [f for f in _flags(spec.command("python")) if f not in LAUNCH_SERVER_FLAGS]
    assert unknown == []


def test_multi_node_cell_needs_an_init_address_and_a_divisible_tp():
    with pytest.raises(ValueError, match="dist_init_addr"):
        SGLangSpec("/m", tp=8, nnodes=4).command("python")
    with pytest.raises(ValueError, match="multiple of the cell's 4 node"):
        SGLangSpec("/m", tp=6, nnodes=4, dist_init_addr="n:1").command("python")
    cmd = SGLangSpec("/m", tp=8, nnodes=4, node_rank=2, dist_init_addr="node01:5000").command("python")
    assert cmd[cmd.index("--node-rank") + 1] == "2" and cmd[cmd.index("--dist-init-addr") + 1] == "node01:5000"
    with pytest.raises(ValueError, match="not a module name"):
        SGLangSpec("/m", launcher="sglang launch").command("python")


def test_srun_step_gives_each_node_its_rank_by_slurm_node_name():
    spec = SGLangSpec("/m dir", tp=4, nnodes=2, dist_init_addr="node03:30100", api_key="k")
    cmd = srun_step(spec, ["node03", "node01"], ["srun", "--jobid=7", "--overlap"], python="python")
    assert cmd[:3] == ["srun", "--jobid=7", "--overlap"]
    assert "--nodes=2" in cmd and "--ntasks-per-node=1" in cmd and "--nodelist=node03,node01" in cmd
    script = cmd[-1]
    assert cmd[-3:-1] == ["bash", "-c"]
    # Run the per-node script with `exec` replaced by printing its argv, as each Slurm task would.
    for node, rank in (("node03", "0"), ("node01", "1")):
        out = subprocess.run(["bash", "-c", script.replace("exec ", "printf '%s\\n' ")], env={"SLURMD_NODENAME": node},
                             capture_output=True, text=True, check=True).stdout
        argv = out.splitlines()
        assert argv[argv.index("--node-rank") + 1] == rank and argv[argv.index("--model-path") + 1] == "/m dir"
    bad = subprocess.run(["bash", "-c", script], env={"SLURMD_NODENAME": "node09"}, capture_output=True, text=True)
    assert bad.returncode == 2 and "node09 is not one of" in bad.stderr
