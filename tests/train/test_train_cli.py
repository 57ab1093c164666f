"""`gyre train`: steps from shards on the tiny model, exported weights the engine loads, and bad
input refused with exit status 2 and a message that says what is wrong."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from gyre.model.identity import model_identity
from gyre.model.tiny import ensure_tiny_model
from gyre.train.cli import main as train_main
from gyre.traj.record import ExecutionRecord
from gyre.traj.store import ShardWriter, shard_identity
from gyre.traj.synthetic import Lengths, Shape, generate

SMALL = Shape(calls=16, subagents=1, subagent_calls=3, compactions=1, retries=1, versions_every=5,
              system=Lengths(40, 0.1), task=Lengths(20, 0.3), assistant=Lengths(12, 0.5),
              tool=Lengths(16, 0.5), summary=Lengths(20, 0.3))
REWARDS = (1.0, 0.0, 0.5, 0.25)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return ensure_tiny_model(tmp_path_factory.getbasetemp() / "tiny-qwen")


def executions(vocab: int | None = 2048, group: int = 0) -> list[ExecutionRecord]:
    """Four scored executions of one task (varied rewards), one unscorable, one stopped."""
    out = []
    for k, reward in enumerate(REWARDS + (float("nan"), float("nan"))):
        r = generate(replace(SMALL, seed=k), execution_id=f"t{group}-e{k}", task=f"task-{group}", group=group)
        if vocab is not None:  # synthetic ids are Qwen's; the tiny model's vocabulary is smaller
            for n in r.tree.nodes:
                n.tokens = (n.tokens % vocab).astype(np.int32)
        r.reward = reward
        out.append(r)
    out[4].reward_source = "unscorable"
    out[5].status, out[5].reward_source = "stopped", "not-evaluated: stopped"
    return out


def write(directory: Path, records, tiny: Path, **identity) -> Path:
    ident = {**shard_identity(model_identity(tiny)), **identity}
    return ShardWriter(directory, identity=ident).write(records)


def run(tmp_path, tiny, *args, overrides=()) -> int:
    return train_main([*args, f"model.tiny_dir={tiny}", f"run.dir={tmp_path / 'run'}", *overrides])


@pytest.mark.slow  # shards written, two steps, the export loaded back: 10-15 s per backend
@pytest.mark.parametrize("backend", ["embedded", "megatron"])
def test_two_steps_export_loadable_weights(tmp_path, tiny, capsys, backend):
    shard = write(tmp_path / "shards", executions(), tiny)
    write(tmp_path / "shards", executions(group=1), tiny)
    out = tmp_path / "out"
    # overrides after --shards (argparse would take them as shards: the command moves them back)
    rc = train_main(["--shards", str(shard.parent), "--steps", "2", "--out", str(out),
                     "--groups-per-step", "1", f"model.tiny_dir={tiny}", "train.lr=1e-3",
                     f"train.backend={backend}", "selection.k=5", "train.micro_batch_tokens=512"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "12 executions read: 8 trainable" in text and "status stopped" in text and "unscorable" in text
    assert len(re.findall(r"step \d+: loss [+-]", text)) == 2 and "grad norm" in text and "trajectories" in text

    log = json.loads((out / "train.json").read_text())
    assert [s["step"] for s in log["steps"]] == [1, 2]
    assert log["executions_trainable"] == 8
    assert log["not_trained"] == {"no reward (unscorable)": 2, "status stopped": 2}
    for s in log["steps"]:  # one group (4 executions) per step
        assert s["executions"] == 4 and s["trajectories"] > 4 and s["tokens"] > 0
        assert np.isfinite(s["loss"]) and s["grad_norm"] > 0

    # the engine loads the export; it is the source model plus two steps of changes
    from gyre.engine.qwen import CausalLM
    from transformers import AutoModelForCausalLM

    weights = out / "weights"
    assert (weights / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()
    assert json.loads((weights / "gyre_weights.json").read_text())["weight_version"] == "2"
    ident = model_identity(weights, recompute=True)
    assert ident == json.loads((weights / "gyre_identity.json").read_text())
    assert ident["model_hash"] != model_identity(tiny)["model_hash"]
    assert ident["tokenizer_hash"] == model_identity(tiny)["tokenizer_hash"]
    CausalLM.from_dir(weights)
    new = AutoModelForCausalLM.from_pretrained(str(weights)).state_dict()
    old = AutoModelForCausalLM.from_pretrained(str(tiny)).state_dict()
    assert new.keys() == old.keys()
    assert any(not torch.equal(new[k], old[k]) for k in old)
    assert (out / "checkpoint" / "trainer.pt").exists()


def error(capsys) -> str:
    return capsys.readouterr().err


def test_bad_inputs_exit_2_with_a_message(tmp_path, tiny, capsys):
    good = write(tmp_path / "good", executions(), tiny)

    assert run(tmp_path, tiny, "--shards", str(tmp_path / "nowhere.h5")) == 2
    assert "no such shard file or directory" in error(capsys)

    (tmp_path / "empty").mkdir()
    assert run(tmp_path, tiny, "--shards", str(tmp_path / "empty")) == 2
    assert "no shards (*.h5)" in error(capsys)

    # nothing trainable: unscorable and unfinished executions only
    only_bad = write(tmp_path / "untrainable", executions()[4:], tiny)
    assert run(tmp_path, tiny, "--shards", str(only_bad)) == 2
    msg = error(capsys)
    assert "no trainable executions" in msg and "unscorable" in msg and "status stopped" in msg

    # an execution that ended before its first call has no trajectory to train
    empty = ExecutionRecord("e-empty", "t", 0, "crashed", 0.0, "tests")
    assert run(tmp_path, tiny, "--shards", str(write(tmp_path / "no-calls", [empty], tiny))) == 2
    assert "no step to train" in error(capsys)

    # identity: another tokenizer recorded these executions
    other = write(tmp_path / "other-tok", executions(), tiny, tokenizer="sha256:someone-else")
    assert run(tmp_path, tiny, "--shards", str(other)) == 2
    assert "tokenizer" in error(capsys)

    # identity undetectable from attributes, but the ids do not fit the model's vocabulary
    wide = write(tmp_path / "wide", executions(vocab=None), tiny)
    assert run(tmp_path, tiny, "--shards", str(wide)) == 2
    assert "outside the model's vocabulary" in error(capsys)

    # a damaged shard stops the command unless told to skip it
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "shard-x.h5").write_bytes(good.read_bytes()[:4096])
    assert run(tmp_path, tiny, "--shards", str(broken)) == 2
    assert "bad shard" in error(capsys)

    # configuration and budget problems
    assert run(tmp_path, tiny, "--shards", str(good), overrides=["train.layout=diagonal"]) == 2
    assert "configuration error: train.layout" in error(capsys)
    assert run(tmp_path, tiny, "--shards", str(good), overrides=["train.micro_batch_tokens=64"]) == 2
    assert "micro_batch_tokens" in error(capsys)
    assert run(tmp_path, tiny, "--shards", str(good), "--steps", "0") == 2
    assert "--steps" in error(capsys)
    bad_model = run(tmp_path, tiny, "--shards", str(good), overrides=[f"model.path={tmp_path / 'empty'}"])
    assert bad_model == 2 and "holds no transformers model" in error(capsys)

    with pytest.raises(SystemExit) as exc:  # argparse: --shards is required
        train_main([])
    assert exc.value.code == 2 and "--shards" in error(capsys)
    assert not (tmp_path / "run").exists()  # nothing was written for refused input
