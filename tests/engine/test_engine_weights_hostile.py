"""Weights a hostile or broken export can put in front of the engine (issue 24): a FIFO where a
weights file goes is refused without blocking anything, and resuming released weights checks
what it reads as a weight update does. A real engine process."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from gyre.engine.launch import start_engine
from gyre.model.tiny import ensure_tiny_model
from support.engine_http import PROMPT, generate, request


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tiny = ensure_tiny_model(tmp_path_factory.getbasetemp() / "tiny-qwen")
    copy = tmp_path_factory.mktemp("served") / "m"
    shutil.copytree(tiny, copy)
    with start_engine(copy, extra_args=["--no-api-key"]) as proc:
        yield proc, copy


@pytest.mark.slow
def test_a_fifo_for_weights_is_refused_and_the_engine_keeps_serving(served, tmp_path):
    proc, model = served
    bad = tmp_path / "fifo-export"
    shutil.copytree(model, bad)
    (bad / "model.safetensors").unlink()
    os.mkfifo(bad / "model.safetensors")
    status, data = request(proc.url, "POST", "/update_weights_from_disk", {"model_path": str(bad), "weight_version": "9"})
    assert status == 400 and "not a regular file" in data["message"], data
    assert generate(proc.url, PROMPT, max_new_tokens=4, temperature=0)["meta_info"]["weight_version"] != "9"


@pytest.mark.slow
def test_resume_checks_the_weights_it_reloads(served):
    proc, model = served
    good = load_file(str(model / "model.safetensors"))
    before = generate(proc.url, PROMPT, max_new_tokens=8, temperature=0)["output_ids"]
    assert request(proc.url, "POST", "/release_memory_occupation", {"tags": ["weights"]})[0] == 200
    shutil.copy2(model / "model.safetensors", model / "good.bak")
    nan = {k: (v.clone().fill_(float("nan")) if k.endswith("embed_tokens.weight") else v) for k, v in good.items()}
    save_file(nan, str(model / "model.safetensors"))
    try:
        status, data = request(proc.url, "POST", "/resume_memory_occupation", {"tags": ["weights"]})
        assert status == 400 and "non-finite" in str(data), data
        assert request(proc.url, "POST", "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})[0] == 503
    finally:
        os.replace(model / "good.bak", model / "model.safetensors")
    assert request(proc.url, "POST", "/resume_memory_occupation", {"tags": ["weights"]})[0] == 200
    assert generate(proc.url, PROMPT, max_new_tokens=8, temperature=0)["output_ids"] == before
    assert torch.isfinite(load_file(str(model / "model.safetensors"))["model.embed_tokens.weight"]).all()
