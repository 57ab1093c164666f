"""A real vLLM server (the CPU build in .venv-vllm, `make install-vllm`) as a cell's engine, started
through the one seam: token truth (its processed log-probs against Gyre's trainer at lag 0),
sampling parameters honoured or refused, and a weight push while calls run (held by pause, never
aborted, versions recorded per call, prefix cache reset). One server for the whole module."""

from __future__ import annotations

import asyncio

import pytest
import torch

from gyre.config import ConfigError, load_config
from gyre.engine import backends
from gyre.engine.backends.vllm import vllm_python
from gyre.engine.client import EngineError
from gyre.engine.launch import start_cell_engine, start_engine
from gyre.model.tiny import SERVING_HEAD_DIM, ensure_tiny_model

from support.vllm_truth import mismatch, sample, trainer_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KEY = "vllm-test-key"
K3_TOL = 1e-5  # float32 on both sides; CPU kernels differ in summation order only


def _cfg(*over):
    return load_config(None, ["engine.backend=vllm", "engine.max_running_requests=16", *over])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.getbasetemp() / "tiny-qwen-hd32", head_dim=SERVING_HEAD_DIM)


@pytest.fixture(scope="module")
def vllm(model_dir):
    """`gyre engine --backend vllm`: the seam starts vLLM's server, the command prints its URL."""
    cfg = _cfg()
    if not vllm_python(cfg).exists():
        pytest.skip(f"no vLLM environment at {vllm_python(cfg)}: run `make install-vllm`")
    with start_engine(model_dir, api_key=KEY, timeout_s=900,
                      extra_args=["--backend", "vllm", "engine.max_running_requests=16"]) as proc:
        proc.admin = backends.get("vllm").admin(cfg, proc.url, KEY, 120.0)
        yield proc


def test_a_missing_vllm_names_the_install_command(model_dir, tmp_path):
    with pytest.raises(ConfigError, match="make install-vllm"):
        start_cell_engine(_cfg(f"engine.vllm_python={tmp_path / 'none' / 'python'}"), model_dir, api_key=KEY)


def test_the_default_tiny_model_is_refused_with_the_servable_variant_named(vllm, tmp_path):
    small = ensure_tiny_model(tmp_path / "tiny16")
    with pytest.raises(ConfigError, match="--head-dim 32"):
        start_cell_engine(_cfg(), small, api_key=KEY)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_lag0_logprobs_match_the_trainer(vllm, model_dir, temperature):
    vllm.admin.load_weights(str(model_dir), "0")  # whatever an earlier test pushed
    mb, results = sample("vllm", vllm.url, KEY, temperature, seed=7)
    assert {r.weight_version for r in results} == {"0"} and {r.finish_reason for r in results} == {"length"}
    m = mismatch(trainer_for(model_dir), mb)
    assert m["tokens"] == 36 and m["k3_mean"] < K3_TOL and m["abs_max"] < 1e-3, m
    if temperature != 1.0:  # the engine's are the processed (temperature 0.7) log-probs, not the raw ones
        mb.temperature = torch.ones_like(mb.temperature)
        assert mismatch(trainer_for(model_dir), mb)["abs_max"] > 0.05


def test_sampling_parameters_are_honoured_or_refused(vllm):
    client_class = backends.get("vllm").client_class

    async def run():
        async with client_class(vllm.url, api_key=KEY) as c:
            a = await c.generate([1, 882, 198], {"max_new_tokens": 5, "temperature": 1.0, "sampling_seed": 3})
            b = await c.generate([1, 882, 198], {"max_new_tokens": 5, "temperature": 1.0, "sampling_seed": 3})
            stop = a.output_ids[2]
            s = await c.generate([1, 882, 198], {"max_new_tokens": 5, "temperature": 1.0, "sampling_seed": 3,
                                                 "stop_token_ids": [stop]})
            g = await c.generate([1, 882, 198], {"max_new_tokens": 4, "temperature": 0.0})
            with pytest.raises(EngineError, match="top_p=0.5 is refused"):
                await c.generate([1, 882], {"max_new_tokens": 3, "top_p": 0.5})
            with pytest.raises(EngineError, match="not supported"):
                await c.generate([1, 882], {"max_new_tokens": 3, "n": 2})
            return a, b, s, g, stop

    a, b, s, g, stop = asyncio.run(run())
    assert a.output_ids == b.output_ids and len(a.output_ids) == 5  # seed honoured, max_new_tokens too
    assert s.finish_reason == "stop" and s.output_ids == a.output_ids[:3] and s.output_ids[-1] == stop
    assert len(g.output_ids) == 4 and all(lp <= 0 for lp in g.logprobs)


def test_a_seeded_call_longer_than_a_prefill_chunk_is_served(vllm):
    """A seeded call whose prompt passes vLLM's 2,048-token prefill chunk: with chunked prefill on,
    vLLM's CPU build rewinds the seed's generator for the partial chunk and its EngineCore dies
    ("CPU Generator does not use offset"); the backend starts it with whole prefills."""
    client_class = backends.get("vllm").client_class

    async def run():
        async with client_class(vllm.url, api_key=KEY) as c:
            return await c.generate([5 + i % 1000 for i in range(3000)],
                                    {"max_new_tokens": 4, "temperature": 1.0, "sampling_seed": 3})

    r = asyncio.run(run())
    assert r.finish_reason == "length" and len(r.output_ids) == 4
    assert vllm.admin.healthy()


PUSH_ROUNDS = 3  # a round whose calls all finished before the pause landed proves no hold: try again


def _push_while_running(vllm, client_class, weights, version: str, n_new: int) -> list:
    """Four seeded calls of ``n_new`` tokens; once each has streamed a token, a push of ``weights``
    labelled ``version``. The client reads behind the server (under load by hundreds of tokens),
    so the calls may already be done server-side when the pause lands."""

    async def run():
        async with client_class(vllm.url, api_key=KEY) as c:
            started = asyncio.Event()
            n_started = 0

            async def one(i):
                nonlocal n_started
                last = None
                async for snap in c.generate_stream([1, 882, 198, 40 + i], {"max_new_tokens": n_new, "temperature": 1.0,
                                                                           "sampling_seed": i, "ignore_eos": True}):
                    if last is None:
                        n_started += 1
                        if n_started == 4:
                            started.set()
                    last = snap
                return last

            calls = [asyncio.create_task(one(i)) for i in range(4)]
            await started.wait()
            await asyncio.to_thread(vllm.admin.load_weights, str(weights), version)
            return await asyncio.gather(*calls)

    return asyncio.run(run())


def test_a_push_during_running_calls_holds_them_and_changes_the_outputs(vllm, model_dir, tmp_path):
    admin = vllm.admin
    admin.load_weights(str(model_dir), "0")
    before, _ = sample("vllm", vllm.url, KEY, 0.0, seed=1)
    trainer = trainer_for(model_dir, lr=0.05)
    mb, _ = sample("vllm", vllm.url, KEY, 1.0, seed=2)
    trainer.forward_backward(mb)
    trainer.optimizer_step()
    pushed = trainer.export_weights(tmp_path / "w1", weight_version="1")
    client_class = backends.get("vllm").client_class

    n_new, held = 1500, []
    for r in range(PUSH_ROUNDS):
        old, new = str(r), str(r + 1)
        results = _push_while_running(vllm, client_class, pushed, new, n_new)
        assert [x.finish_reason for x in results] == ["length"] * 4  # none aborted
        assert all(len(x.output_ids) == n_new for x in results)
        for x in results:  # each token under exactly one version: the old one, then (held) the new
            spans = x.meta_info["weight_versions"]
            assert [s["version"] for s in spans] in ([old], [old, new]), spans
            assert spans[0]["start"] == 0 and spans[-1]["end"] == n_new, spans
            assert all(a["end"] == b["start"] for a, b in zip(spans, spans[1:])), spans
        held = [x for x in results if len(x.meta_info["weight_versions"]) == 2]
        if held:  # paused mid-call, resumed on the new weights, nothing aborted
            break
    assert held, f"in {PUSH_ROUNDS} rounds every call had finished before the push's pause landed"
    assert admin.weight_version() == new and not admin.is_paused()
    after, results = sample("vllm", vllm.url, KEY, 0.0, seed=1)
    assert {r.weight_version for r in results} == {new}
    assert after.input_ids.tolist() != before.input_ids.tolist()  # greedy outputs changed: new weights serve
    m = mismatch(trainer, after)  # ...and they are the trainer's weights (lag 0 again)
    assert m["k3_mean"] < K3_TOL and m["abs_max"] < 1e-3, m
    admin.reset_prefix_cache()  # nothing running: the reset succeeds (after the push it already ran)
