"""The embedded engine past the 32K context of the default tiny model (issue 28 item 4): the long
variant (``gyre make-model --max-positions 262144``) serves a request past 32,768 tokens, and a
prompt chunk's attention is computed in slices of queries (memory O(slice x context)) with the
same result as all at once. A real 40K-token prefill takes minutes on these CPUs, so the served
request finds most of its prompt in the prefix cache (a made-up cache: this tests the limits,
positions and cache reuse, not the logits); benchmarks/xlong_serving.py measures a chunk at 256K."""

from __future__ import annotations

import threading

import pytest
import torch

from gyre.engine import qwen
from gyre.engine.qwen import CausalLM, KVCache
from gyre.engine.runtime import Engine, Refused
from gyre.engine.sampling import SamplingParams
from gyre.model.tiny import LONG_POSITIONS, ensure_tiny_model

pytestmark = pytest.mark.slow  # building the long variant takes ~10 s on 2 cores


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("long") / "tiny-long", max_positions=LONG_POSITIONS)


def test_attention_in_query_slices_equals_the_whole_chunk(long_dir, monkeypatch):
    model = CausalLM.from_dir(long_dir)
    ids = torch.randint(0, 2000, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    whole = KVCache(model.spec)
    model.forward(ids[:100], whole)
    want = model.forward(ids[100:], whole)
    # a budget of a few queries per slice: the 200-token chunk over 300 keys runs in 20 slices
    monkeypatch.setattr(qwen, "ATTN_SCORE_BYTES", 2 * 4 * model.spec.heads * 300 * 10)
    sliced = KVCache(model.spec)
    model.forward(ids[:100], sliced)
    got = model.forward(ids[100:], sliced)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sliced.v[1][:, :300], whole.v[1][:, :300])


def _serve(engine: Engine, ids: list[int]):
    done, box = threading.Event(), {}
    engine.submit("long", ids, SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True),
                  lambda f: (box.setdefault("f", f), done.set()))
    assert done.wait(120), "the long request did not finish"
    return box["f"]


def test_long_variant_serves_past_32k_tokens(long_dir, tmp_path):
    n = 40_000
    ids = torch.randint(0, 2000, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    engine = Engine(long_dir)
    try:
        assert engine.max_context == LONG_POSITIONS
        cache = KVCache(engine.spec, capacity=n - 8)
        for t in cache.k + cache.v:
            t.normal_(generator=torch.Generator().manual_seed(2))
        cache.length = n - 8
        engine._prefix.insert(ids[: n - 8], cache)  # as if an earlier call of the execution had run it
        f = _serve(engine, ids)
        assert f.finish_reason["type"] == "length" and len(f.output_ids) == 3
        assert f.prompt_tokens == n and f.cached_tokens == n - 8
        assert all(lp <= 0.0 for lp in f.logprobs)
    finally:
        engine.close()
    short = Engine(ensure_tiny_model(tmp_path / "tiny-default"))
    try:  # the default variant refuses it as SGLang does
        with pytest.raises(Refused, match=r"longer than the model's context length \(32768 tokens\)"):
            short.submit("long", ids, SamplingParams(max_new_tokens=3), lambda f: None)
    finally:
        short.close()


def test_make_model_refuses_another_range_in_the_same_directory(long_dir):
    with pytest.raises(ValueError, match="262144 positions, not 32768"):
        ensure_tiny_model(long_dir)


def test_make_model_cli_names_the_range(long_dir, capsys):
    from gyre.cli import main as gyre_main

    assert gyre_main(["make-model", "--out", str(long_dir), "--max-positions", str(LONG_POSITIONS)]) == 0
    assert str(long_dir) in capsys.readouterr().out
    assert gyre_main(["make-model", "--out", str(long_dir)]) == 2  # the default range: refused, not rebuilt
    assert "262144 positions, not 32768" in capsys.readouterr().err
