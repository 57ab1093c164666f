"""Engine contract: every route of the embedded engine, over real HTTP, against a subprocess."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from gyre.engine.client import EngineClient, EngineError, EngineUnreachable
from gyre.engine.launch import EngineStartError, start_engine
from gyre.model.checksums import write_checksums
from gyre.model.tiny import ensure_tiny_model
from support.engine_http import generate, PROMPT, request, stream_generate


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.getbasetemp() / "tiny-qwen")


@pytest.fixture(scope="module")
def engine(tiny):
    with start_engine(tiny, extra_args=["--no-api-key", "--set", "engine.max_body_bytes=16384"]) as proc:
        yield proc


@pytest.fixture(scope="module")
def hf_model(tiny):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32, attn_implementation="eager").eval()


def in_background(fn, *args, **kwargs):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("value", fn(*args, **kwargs)))
    t.start()
    return t, out


def running_in_background(url, ids, **sp):
    """A streamed generation in a thread, returned once its first token exists (it is running);
    ``out["value"]`` is then its final chunk, which has the non-streamed shape."""
    started = threading.Event()
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("value", stream_generate(url, ids, started, **sp)[-1]))
    t.start()
    assert started.wait(30), "request never started"
    return t, out

def reference_logprobs(model, prompt, output, temperature=1.0, top_k=-1, top_p=1.0):
    """Log-probs of ``output`` as SGLang reports them (``log_softmax(logits / T)``, unfiltered),
    from a transformers forward; also checks each sampled token lies in the top-k/top-p set."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1: -1].double()
    out, kept_all = [], []
    for row, tok in zip(logits, output):
        if temperature == 0:
            out.append(torch.log_softmax(row, -1)[tok].item())
            continue
        z = row / temperature
        keep = torch.ones_like(z, dtype=torch.bool)
        if top_k > 0:
            keep &= z >= torch.sort(z, descending=True).values[top_k - 1]
        probs = torch.softmax(z.masked_fill(~keep, float("-inf")), -1)
        order = torch.argsort(probs, descending=True)
        mass, nucleus = 0.0, set()
        for i in order.tolist():  # smallest prefix of the sorted tokens reaching top_p
            if mass >= top_p:
                break
            nucleus.add(i)
            mass += probs[i].item()
        keep &= torch.tensor([i in nucleus for i in range(len(z))])
        out.append(torch.log_softmax(z, -1)[tok].item())
        kept_all.append(keep[tok].item())
    assert all(kept_all), "a token outside the top-k/top-p set was sampled"
    return out


# ---- /generate ------------------------------------------------------------------------------

def test_generate_fields(engine):
    data = generate(engine.url, PROMPT, max_new_tokens=6, temperature=0, rid="fields-1")
    meta = data["meta_info"]
    assert len(data["output_ids"]) == 6 and isinstance(data["text"], str)
    assert meta["id"] == "fields-1" and meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["weight_version"] == "0" and meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == 6
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == data["output_ids"]
    # SGLang: the token text only with return_text_in_logprobs
    assert all(isinstance(t[0], float) and t[0] <= 0 and t[2] is None for t in triples)
    status, with_text = request(engine.url, "POST", "/generate", {
        "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "temperature": 0}, "return_logprob": True,
        "return_text_in_logprobs": True, "top_logprobs_num": 3})
    assert status == 200 and all(isinstance(t[2], str) for t in with_text["meta_info"]["output_token_logprobs"])
    tops = with_text["meta_info"]["output_top_logprobs"]
    assert len(tops) == 3 and all(len(pos) == 3 for pos in tops)
    for (lp, tid, _), pos in zip(with_text["meta_info"]["output_token_logprobs"], tops):
        assert pos[0][1] == tid and pos[0][0] == pytest.approx(lp)  # greedy: the sampled token is the top one
        assert pos[0][0] >= pos[1][0] >= pos[2][0]
    # Without return_logprob, no log-probs (as SGLang).
    status, plain = request(engine.url, "POST", "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and "output_token_logprobs" not in plain["meta_info"]


def test_greedy_is_deterministic_and_matches_transformers(engine, hf_model):
    a = generate(engine.url, PROMPT, max_new_tokens=24, temperature=0)
    b = generate(engine.url, PROMPT, max_new_tokens=24, temperature=0)
    assert a["output_ids"] == b["output_ids"]
    with torch.no_grad():
        hf = hf_model.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert a["output_ids"] == hf
    got = [t[0] for t in a["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx(reference_logprobs(hf_model, PROMPT, a["output_ids"], temperature=0), abs=1e-4)


@pytest.mark.parametrize("params", [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=20),
    dict(temperature=0.7, top_k=50, top_p=0.8),
    dict(temperature=0.7, top_p=0.5),
])
def test_logprobs_are_those_of_the_sampling_distribution(engine, hf_model, params):
    data = generate(engine.url, PROMPT, max_new_tokens=40, ignore_eos=True, sampling_seed=7, **params)
    got = [t[0] for t in data["meta_info"]["output_token_logprobs"]]
    ref = reference_logprobs(hf_model, PROMPT, data["output_ids"], params["temperature"],
                             params.get("top_k", -1), params.get("top_p", 1.0))
    assert got == pytest.approx(ref, abs=1e-4)
    # The same seed replays the same sample.
    again = generate(engine.url, PROMPT, max_new_tokens=40, ignore_eos=True, sampling_seed=7, **params)
    assert again["output_ids"] == data["output_ids"]


def test_long_prompt_chunked_prefill_matches_transformers(engine, hf_model):
    prompt = [(i * 37 + 11) % 2000 + 3 for i in range(2600)]  # longer than two prefill chunks
    data = generate(engine.url, prompt, max_new_tokens=5, temperature=1.0, sampling_seed=3)
    got = [t[0] for t in data["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx(reference_logprobs(hf_model, prompt, data["output_ids"]), abs=1e-4)


def test_stop_token_is_included_in_output_ids(engine):
    greedy = generate(engine.url, PROMPT, max_new_tokens=10, temperature=0)["output_ids"]
    stop = greedy[3]
    cut = greedy.index(stop) + 1
    data = generate(engine.url, PROMPT, max_new_tokens=10, temperature=0, stop_token_ids=[stop])
    assert data["output_ids"] == greedy[:cut]
    assert data["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert len(data["meta_info"]["output_token_logprobs"]) == cut


def test_prefix_cache_reuse_gives_same_logprobs(engine):
    assert request(engine.url, "POST", "/flush_cache", {})[0] == 200  # earlier tests cached PROMPT
    first = generate(engine.url, PROMPT, max_new_tokens=8, temperature=0)
    follow = PROMPT + first["output_ids"] + [198, 1, 77]
    cached = generate(engine.url, follow, max_new_tokens=8, temperature=0)
    assert cached["meta_info"]["cached_tokens"] == len(PROMPT) + 8 - 1
    assert request(engine.url, "POST", "/flush_cache", {})[0] == 200
    fresh = generate(engine.url, follow, max_new_tokens=8, temperature=0)
    assert fresh["meta_info"]["cached_tokens"] == 0
    assert fresh["output_ids"] == cached["output_ids"]
    assert [t[0] for t in fresh["meta_info"]["output_token_logprobs"]] == pytest.approx(
        [t[0] for t in cached["meta_info"]["output_token_logprobs"]], abs=1e-5)


def test_concurrent_requests_do_not_block_health(engine):
    prompts = [PROMPT * (1 + i % 3) + [100 + i] for i in range(12)]  # different lengths, one batch
    sequential = [generate(engine.url, p, max_new_tokens=30, temperature=0) for p in prompts]
    threads = [in_background(generate, engine.url, p, max_new_tokens=300, temperature=0, ignore_eos=True)
               for p in prompts]
    worst = 0.0
    while any(t.is_alive() for t, _ in threads):
        t0 = time.monotonic()
        assert request(engine.url, "GET", "/health")[0] == 200
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.02)
    assert worst < 1.0, f"health check took {worst:.2f}s while generating"
    for (t, out), seq in zip(threads, sequential):
        t.join()
        # Batched decoding with per-request KV caches changes nobody's tokens or log-probs.
        assert out["value"]["output_ids"][:30] == seq["output_ids"]
        assert [t[0] for t in out["value"]["meta_info"]["output_token_logprobs"][:30]] == pytest.approx(
            [t[0] for t in seq["meta_info"]["output_token_logprobs"]], abs=1e-4)


# ---- abort, memory, cache -------------------------------------------------------------------

def test_release_refused_while_running_and_abort(engine):
    t, out = running_in_background(engine.url, PROMPT, max_new_tokens=4000, ignore_eos=True, rid="long-1")
    status, data = request(engine.url, "POST", "/release_memory_occupation", {"tags": ["kv_cache", "weights"]})
    assert status == 400 and "running" in data["error"]["message"]
    status, data = request(engine.url, "POST", "/flush_cache", {})
    assert status == 400 and data.startswith("Cache flushed.")  # SGLang's text, with 400
    status, data = request(engine.url, "POST", "/abort_request", {"rid": "long-1"})
    assert status == 200 and data is None  # SGLang: an empty 200
    t.join(30)
    res = out["value"]
    assert res["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(res["output_ids"]) < 4000 and len(res["meta_info"]["output_token_logprobs"]) == len(res["output_ids"])


def test_abort_all(engine):
    threads = [running_in_background(engine.url, PROMPT + [i], max_new_tokens=4000, ignore_eos=True) for i in range(3)]
    status, data = request(engine.url, "POST", "/abort_request", {"abort_all": True})
    assert status == 200 and data is None
    for t, out in threads:
        t.join(30)
        assert out["value"]["meta_info"]["finish_reason"]["type"] == "abort"


def test_release_and_resume_memory(engine):
    before = generate(engine.url, PROMPT, max_new_tokens=8, temperature=0)["output_ids"]
    status, data = request(engine.url, "POST", "/release_memory_occupation", {"tags": ["kv_cache", "weights"]})
    assert status == 200 and data is None  # SGLang's handler returns nothing
    status, data = request(engine.url, "POST", "/generate", {"input_ids": PROMPT})
    assert status == 503 and "resume_memory_occupation" in data["error"]["message"]
    assert request(engine.url, "GET", "/health")[0] == 200  # still alive while released
    status, data = request(engine.url, "POST", "/resume_memory_occupation", {"tags": ["kv_cache", "weights"]})
    assert status == 200 and data is None
    assert generate(engine.url, PROMPT, max_new_tokens=8, temperature=0)["output_ids"] == before


# ---- weights --------------------------------------------------------------------------------

def _perturbed_copy(src, dst, scale=0.05):
    """What a trainer export looks like: config.json + model.safetensors, no tokenizer."""
    dst.mkdir()
    shutil.copyfile(src / "config.json", dst / "config.json")
    tensors = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    tensors = {n: t + scale * torch.randn(t.shape, generator=gen) for n, t in tensors.items()}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    write_checksums(dst)  # as an export does: the engine requires it
    return dst


def test_update_weights_from_disk(engine, tiny, tmp_path):
    new = _perturbed_copy(tiny, tmp_path / "v1")
    old_out = generate(engine.url, PROMPT, max_new_tokens=16, temperature=0)
    # A request in flight when the update arrives finishes on the old weights; the update waits.
    t, inflight = running_in_background(engine.url, PROMPT, max_new_tokens=1000, ignore_eos=True, temperature=0)
    status, data = request(engine.url, "POST", "/update_weights_from_disk",
                           {"model_path": str(new), "weight_version": "1"})
    assert status == 200 and data["success"] and "Weight version updated to 1" in data["message"]
    assert set(data) == {"success", "message", "num_paused_requests"} and data["num_paused_requests"] == 1
    t.join(60)
    assert inflight["value"]["meta_info"]["finish_reason"]["type"] == "length"
    assert inflight["value"]["meta_info"]["weight_version"] == "0"
    assert inflight["value"]["output_ids"][:16] == old_out["output_ids"]

    assert request(engine.url, "GET", "/get_weight_version")[1] == {"weight_version": "1"}
    new_out = generate(engine.url, PROMPT, max_new_tokens=16, temperature=0)
    assert new_out["meta_info"]["weight_version"] == "1"
    assert new_out["output_ids"] != old_out["output_ids"]
    info = request(engine.url, "GET", "/get_model_info")[1]
    assert info["model_path"] == str(new) and info["weight_version"] == "1"

    # Back to the original weights: original outputs again.
    status, data = request(engine.url, "POST", "/update_weights_from_disk", {"model_path": str(tiny), "weight_version": "2"})
    assert status == 200
    again = generate(engine.url, PROMPT, max_new_tokens=16, temperature=0)
    assert again["output_ids"] == old_out["output_ids"] and again["meta_info"]["weight_version"] == "2"


def test_bad_weight_updates_keep_serving(engine, tiny, tmp_path):
    version = request(engine.url, "GET", "/get_weight_version")[1]["weight_version"]
    broken = tmp_path / "broken"
    shutil.copytree(tiny, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    write_checksums(broken)  # the checksums hold: the layout is what is wrong
    for path, words in ((tmp_path / "nope", "does not exist"), (broken, "up_proj")):
        status, data = request(engine.url, "POST", "/update_weights_from_disk", {"model_path": str(path), "weight_version": "x"})
        assert status == 400 and data["success"] is False and words in data["message"]
    assert request(engine.url, "GET", "/get_weight_version")[1]["weight_version"] == version
    generate(engine.url, PROMPT, max_new_tokens=2)


def test_model_info_and_health_answer_as_sglang(engine, tiny):
    status, info = request(engine.url, "GET", "/get_model_info")
    assert status == 200 and set(info) == {"model_path", "tokenizer_path", "is_generation",
                                           "preferred_sampling_params", "weight_version"}
    assert info["is_generation"] is True
    for path in ("/health", "/health_generate"):  # SGLang: an empty 200, no load figures
        assert request(engine.url, "GET", path) == (200, None)
    status, server = request(engine.url, "GET", "/get_server_info")
    assert status == 200 and server["max_req_input_len"] == server["context_length"] - 1 == 32767
    status, text = request(engine.url, "GET", "/flush_cache")
    assert status == 200 and text.startswith("Cache flushed.")


# ---- bad input ------------------------------------------------------------------------------

BAD = [
    ("malformed json", "POST", "/generate", b'{"input_ids": [1, 2', 400, "malformed JSON"),
    ("non utf-8", "POST", "/generate", b'{"input_ids": [1, 2], "rid": "\xff\xfe"}', 400, "UTF-8"),
    ("not an object", "POST", "/generate", b"[1, 2, 3]", 400, "JSON object"),
    ("ids wrong type", "POST", "/generate", {"input_ids": "hello"}, 400, "input_ids"),
    ("ids with bool", "POST", "/generate", {"input_ids": [1, True]}, 400, "input_ids"),
    ("ids empty", "POST", "/generate", {"input_ids": []}, 400, "input_ids"),
    ("ids missing", "POST", "/generate", {"sampling_params": {}}, 400, "input_ids is required"),
    ("id out of vocab", "POST", "/generate", {"input_ids": [1, 5000]}, 400, "outside the vocabulary"),
    ("negative id", "POST", "/generate", {"input_ids": [1, -1]}, 400, "outside the vocabulary"),
    ("unknown key", "POST", "/generate", {"input_ids": [1], "prompt": "x"}, 400, "unknown key"),
    ("unknown sampling key", "POST", "/generate", {"input_ids": [1], "sampling_params": {"temprature": 1}}, 400, "temprature"),
    ("temperature type", "POST", "/generate", {"input_ids": [1], "sampling_params": {"temperature": "hot"}}, 400, "temperature"),
    ("top_k zero", "POST", "/generate", {"input_ids": [1], "sampling_params": {"top_k": 0}}, 400, "top_k"),
    ("top_p range", "POST", "/generate", {"input_ids": [1], "sampling_params": {"top_p": 1.5}}, 400, "top_p"),
    ("min_p range", "POST", "/generate", {"input_ids": [1], "sampling_params": {"min_p": 2}}, 400, "min_p"),
    ("stop ids", "POST", "/generate", {"input_ids": [1], "sampling_params": {"stop_token_ids": [99999]}}, 400, "stop_token_ids"),
    ("over the cap", "POST", "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 10**6}}, 400, "cap"),
    ("stream type", "POST", "/generate", {"input_ids": [1], "stream": "yes"}, 400, "stream"),
    ("seed too large", "POST", "/generate", {"input_ids": [1], "sampling_params": {"sampling_seed": 2**70}}, 400,
     "sampling_seed"),
    ("stop type", "POST", "/generate", {"input_ids": [1], "sampling_params": {"stop": [1]}}, 400, "stop"),
    ("top logprobs", "POST", "/generate", {"input_ids": [1], "top_logprobs_num": 99}, 400, "top_logprobs_num"),
    ("deep nesting", "POST", "/generate", b'{"input_ids": ' + b"[" * 100000 + b"]" * 100000 + b"}", 413, "limit"),
    ("nesting", "POST", "/generate", b'{"rid": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "nested"),
    ("rid type", "POST", "/generate", {"input_ids": [1], "rid": 5}, 400, "rid"),
    ("batched", "POST", "/generate", {"input_ids": [[1], [2]]}, 400, "batched"),
    ("too large", "POST", "/generate", {"input_ids": [1] * 6000}, 413, "limit is 16384 bytes"),
    ("unknown route", "GET", "/v1/nothing", None, 404, "unknown route"),
    ("wrong method", "GET", "/generate", None, 405, "POST"),
    ("abort without target", "POST", "/abort_request", {}, 400, "rid or abort_all"),
    ("bad tags", "POST", "/release_memory_occupation", {"tags": ["gpu"]}, 400, "tags"),
    ("update no path", "POST", "/update_weights_from_disk", {"weight_version": "3"}, 400, "model_path"),
]


@pytest.mark.parametrize("name,method,path,body,status,words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_clear_4xx(engine, name, method, path, body, status, words):
    raw = body if isinstance(body, bytes) else None
    got, data = request(engine.url, method, path, None if raw else body, raw=raw)
    assert got == status, data
    assert data["error"]["code"] == status and words in data["error"]["message"]


def test_still_serving_after_bad_input(engine):
    for _, method, path, body, _, _ in BAD:
        raw = body if isinstance(body, bytes) else None
        request(engine.url, method, path, None if raw else body, raw=raw)
    assert generate(engine.url, PROMPT, max_new_tokens=3)["meta_info"]["completion_tokens"] == 3
    assert request(engine.url, "GET", "/health")[0] == 200
    assert engine.proc.poll() is None


# ---- API key and client ---------------------------------------------------------------------

def test_api_key_required_on_every_route(tiny):
    with start_engine(tiny, api_key="s3cret") as proc:
        for method, path, body in (("GET", "/health", None), ("GET", "/get_weight_version", None),
                                   ("POST", "/generate", {"input_ids": [1]}), ("GET", "/nowhere", None)):
            assert request(proc.url, method, path, body)[0] == 401
            assert request(proc.url, method, path, body, {"Authorization": "Bearer wrong"})[0] == 401
        assert request(proc.url, "GET", "/health", headers={"Authorization": "Bearer s3cret"})[0] == 200
        # A prompt as long as the context: SGLang's 400 and wording, before any compute.
        status, data = request(proc.url, "POST", "/generate", {"input_ids": [1] * 32768},
                               {"Authorization": "Bearer s3cret"})
        assert status == 400 and "The input (32768 tokens) is longer than the model's context length (32768 tokens)" \
            in data["error"]["message"]

        async def via_client():
            async with EngineClient(proc.url, api_key="s3cret") as c:
                res = await c.generate([1, 2, 3], {"max_new_tokens": 3})
                assert len(res.output_ids) == 3 and res.endpoint == proc.url
            async with EngineClient(proc.url, api_key="nope") as c:
                with pytest.raises(EngineError) as e:
                    await c.generate([1, 2, 3], {"max_new_tokens": 3})
                assert e.value.status == 401

        asyncio.run(via_client())


def test_client_api(engine, tiny):
    async def scenario():
        async with EngineClient(engine.url) as c:
            assert await c.health()
            res = await c.generate(PROMPT, {"max_new_tokens": 5, "temperature": 0}, rid="client-1")
            assert res.rid == "client-1" and res.finish_reason == "length" and len(res.logprobs) == 5
            assert res.weight_version == await c.weight_version() and res.endpoint == engine.url
            with pytest.raises(EngineError) as e:  # a 4xx is raised at once, with the engine's message
                await c.generate([99999], {})
            assert e.value.status == 400 and "vocabulary" in e.value.message
            # Streamed: snapshots are cumulative whatever the engine sends; the first one means it runs.
            stream = c.generate_stream(PROMPT, {"max_new_tokens": 4000, "ignore_eos": True}, rid="client-2",
                                       top_logprobs_num=2)
            first = await stream.__anext__()
            assert first.finish_reason is None and len(first.output_ids) >= 1
            with pytest.raises(EngineError):
                await c.release_memory(["weights"])
            await c.abort(rid="client-2")
            snaps = [s async for s in stream]
            last = snaps[-1]
            assert last.finish_reason == "abort" and last.output_ids[: len(first.output_ids)] == first.output_ids
            assert len(last.logprobs) == len(last.output_ids) == len(last.top_logprobs)
            await c.flush_cache()
            await c.release_memory(["kv_cache"])
            await c.resume_memory(["kv_cache"])
            version = await c.weight_version()
            await c.update_weights_from_disk(str(tiny), version)
            assert await c.weight_version() == version

    asyncio.run(scenario())


@pytest.mark.slow
def test_unservable_model_fails_to_start_clearly(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    for model in (tmp_path / "missing", tmp_path):
        with pytest.raises(EngineStartError, match="cannot serve"):
            start_engine(model, timeout_s=60, extra_args=["--no-api-key"])


def test_client_unreachable_endpoint():
    async def scenario():
        c = EngineClient("http://127.0.0.1:9", connect_retries=2, retry_backoff_s=0.01)
        assert not await c.health()
        t0 = time.monotonic()
        with pytest.raises(EngineUnreachable) as e:
            await c.generate([1], {})
        assert "3 attempt" in str(e.value) and time.monotonic() - t0 < 5
        await c.close()

    asyncio.run(scenario())
