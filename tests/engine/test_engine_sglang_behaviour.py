"""Embedded engine behaviours a harness depends on (issue 13): stop strings end generation in
the engine, /generate streams as SGLang's does, weights are verified before they replace the
served ones, and the API key is on by default."""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import stat
import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from gyre.engine.launch import start_engine
from gyre.model.checksums import MANIFEST, write_checksums
from gyre.model.tiny import ensure_tiny_model
from gyre.model.tokenizer import load_tokenizer
from support.engine_http import PROMPT, generate, request, stream_generate
from support.inprocess_engine import InProcessEngine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


@pytest.fixture(scope="module")
def engine(tiny):
    with start_engine(tiny, extra_args=["--no-api-key"]) as proc:
        yield proc


def test_stop_string_ends_generation_in_the_engine(engine, tiny):
    tok = load_tokenizer(tiny)
    free = generate(engine.url, PROMPT, max_new_tokens=40, temperature=0, ignore_eos=True)
    ids = free["output_ids"]
    # a stop string completed by the 6th output token: the text of tokens 5..6
    stop = tok.decode(ids[4:6], skip_special_tokens=False)
    full_before = tok.decode(ids[:4], skip_special_tokens=False)
    assume = stop.strip() and stop not in full_before
    if not assume:
        pytest.skip("greedy output of the tiny model has no usable stop string here")
    got = generate(engine.url, PROMPT, max_new_tokens=40, temperature=0, ignore_eos=True, stop=[stop])
    meta = got["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": stop}
    n = len(got["output_ids"])
    assert got["output_ids"] == ids[:n] and n <= 6 and meta["completion_tokens"] == n  # 6 tokens, not 40
    assert stop in tok.decode(ids[:n], skip_special_tokens=False)
    assert got["text"] == tok.decode(ids[:n]).split(stop)[0]  # cut before the stop string
    kept = generate(engine.url, PROMPT, max_new_tokens=40, temperature=0, ignore_eos=True, stop=stop,
                    no_stop_trim=True)
    assert kept["text"].endswith(stop)


class _OneRoundPerChunk:
    """A pacer (the engine's per-round seam) that lets the engine run one round per permit: the
    reader hands a permit back for each chunk it reads, so every chunk is one token more, however
    loaded the machine is (without it, tokens decoded before the stream wakes share a chunk, as in
    SGLang)."""

    def __init__(self):
        self.permits = threading.Semaphore(1)

    def start(self):
        assert self.permits.acquire(timeout=60), "the reader stopped handing out rounds"

    def finish(self, *_):
        pass

    def done(self):
        pass


def test_stream_is_sglangs_cumulative_sse_and_ends_like_the_plain_answer(tiny):
    with InProcessEngine(tiny) as eng:
        plain = generate(eng.url, PROMPT, max_new_tokens=12, temperature=0, ignore_eos=True)
        eng.engine.pacer = gate = _OneRoundPerChunk()
        chunks = stream_generate(eng.url, PROMPT, max_new_tokens=12, temperature=0, ignore_eos=True,
                                 on_chunk=gate.permits.release)
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert [len(c["output_ids"]) for c in chunks] == list(range(1, 13))  # the 12th is the finished chunk
    for c in chunks:  # cumulative: every chunk holds all ids and log-probs so far
        assert c["output_ids"] == plain["output_ids"][: len(c["output_ids"])]
        assert c["meta_info"]["completion_tokens"] == len(c["output_ids"])
        assert len(c["meta_info"]["output_token_logprobs"]) == len(c["output_ids"])
    last = chunks[-1]
    assert last["output_ids"] == plain["output_ids"] and last["text"] == plain["text"]
    assert last["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]


def test_incremental_streaming_output_flag(tiny):
    with start_engine(tiny, extra_args=["--no-api-key", "--incremental-streaming-output"]) as eng:
        plain = generate(eng.url, PROMPT, max_new_tokens=10, temperature=0, ignore_eos=True)
        chunks = stream_generate(eng.url, PROMPT, max_new_tokens=10, temperature=0, ignore_eos=True)
        joined = [t for c in chunks for t in c["output_ids"]]
        assert joined == plain["output_ids"] and "".join(c["text"] for c in chunks) == plain["text"]
        assert [c["meta_info"]["completion_tokens"] for c in chunks][-1] == 10

        async def via_client():  # the client turns either form into cumulative snapshots
            from gyre.engine.client import EngineClient

            async with EngineClient(eng.url) as c:
                snaps = [s async for s in c.generate_stream(PROMPT, {"max_new_tokens": 10, "temperature": 0,
                                                                     "ignore_eos": True})]
            return snaps[-1]

        last = asyncio.run(via_client())
        assert last.output_ids == plain["output_ids"] and len(last.logprobs) == 10


def _copy(src, dst, mutate=None):
    dst.mkdir()
    shutil.copyfile(src / "config.json", dst / "config.json")
    tensors = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(3)
    tensors = {n: t + 0.05 * torch.randn(t.shape, generator=gen) for n, t in tensors.items()}
    if mutate:
        mutate(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_weights_are_verified_before_they_replace_the_served_ones(engine, tiny, tmp_path):
    before = generate(engine.url, PROMPT, max_new_tokens=8, temperature=0)["output_ids"]
    version = request(engine.url, "GET", "/get_weight_version")[1]["weight_version"]

    flipped = _copy(tiny, tmp_path / "flipped")
    write_checksums(flipped)
    f = flipped / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-100] ^= 0x01  # one bit flipped in a tensor after export
    f.write_bytes(bytes(data))

    def poison(t):
        t["model.layers.0.mlp.up_proj.weight"][0, 0] = math.nan

    nan = _copy(tiny, tmp_path / "nan", poison)
    write_checksums(nan)
    unlisted = _copy(tiny, tmp_path / "unlisted")  # issue 34: an export without a manifest was served unchecked
    config = _copy(tiny, tmp_path / "config")  # ... and config.json was not covered by it
    write_checksums(config)
    cfg = json.loads((config / "config.json").read_text())
    (config / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": cfg["rms_norm_eps"] * 10}))
    for path, words in ((flipped, "does not match the exported"), (nan, "non-finite"),
                        (unlisted, f"has no {MANIFEST}"), (config, "config.json: sha256")):
        status, data = request(engine.url, "POST", "/update_weights_from_disk",
                               {"model_path": str(path), "weight_version": "bad"})
        assert status == 400 and data["success"] is False and words in data["message"], data
        assert "previous weights stay loaded" in data["message"]
    assert request(engine.url, "GET", "/get_weight_version")[1]["weight_version"] == version
    assert generate(engine.url, PROMPT, max_new_tokens=8, temperature=0)["output_ids"] == before

    good = _copy(tiny, tmp_path / "good")
    assert write_checksums(good).name == MANIFEST
    assert stat.S_IMODE(os.stat(good / MANIFEST).st_mode) == 0o600
    status, data = request(engine.url, "POST", "/update_weights_from_disk", {"model_path": str(good), "weight_version": "7"})
    assert status == 200 and data["success"]
    assert generate(engine.url, PROMPT, max_new_tokens=8, temperature=0)["output_ids"] != before
    request(engine.url, "POST", "/update_weights_from_disk", {"model_path": str(tiny), "weight_version": version})


@pytest.mark.slow
def test_api_key_is_on_by_default(tiny, tmp_path):
    env = dict(os.environ, GYRE_CACHE=str(tmp_path / "cache"))
    proc = subprocess.Popen([sys.executable, "-m", "gyre.engine.cli", "--model", str(tiny), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        key_file = url = None
        for line in proc.stdout:
            if line.startswith("GYRE_ENGINE_KEY_FILE"):
                key_file = line.split(maxsplit=1)[1].strip()
            if line.startswith("GYRE_ENGINE_LISTENING"):
                url = line.split()[1]
                break
        assert key_file and url
        assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
        key = open(key_file).read().strip()
        assert len(key) >= 32
        assert request(url, "GET", "/health")[0] == 401
        assert request(url, "GET", "/health", headers={"Authorization": f"Bearer {key}"})[0] == 200
    finally:
        proc.terminate()
        proc.wait(20)
    assert not os.path.exists(key_file)  # the generated key goes with its engine

    # without a key only when asked, and with a warning
    proc = subprocess.Popen([sys.executable, "-m", "gyre.engine.cli", "--model", str(tiny), "--port", "0",
                             "--no-api-key"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("GYRE_ENGINE_LISTENING"):
                url = line.split()[1]
                break
        assert any("WARNING" in ln and "WITHOUT an API key" in ln for ln in lines)
        assert request(url, "GET", "/health")[0] == 200
    finally:
        proc.terminate()
        proc.wait(20)
