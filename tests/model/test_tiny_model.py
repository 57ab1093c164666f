"""The embedded tokenizer and tiny model: offline, deterministic, Qwen-shaped."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file

from gyre.model import build_tokenizer
from gyre.model.identity import IDENTITY_FILE, compute_identity, model_identity
from gyre.model.tiny import ensure_tiny_model
from gyre.model.tokenizer import load_tokenizer, special_ids


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.getbasetemp() / "tiny-qwen")


def _ids(text: str) -> tuple:
    """What decides token ids: vocabulary, merges, added tokens (not the JSON formatting)."""
    d = json.loads(text)
    return d["model"]["vocab"], d["model"]["merges"], [(t["id"], t["content"], t["special"]) for t in d["added_tokens"]]


def test_committed_tokenizer_is_a_fresh_deterministic_build():
    first, second = build_tokenizer.render(build_tokenizer.build()), build_tokenizer.render(build_tokenizer.build())
    assert first == second
    assert _ids(build_tokenizer.ASSET.read_text(encoding="utf-8")) == _ids(first), (
        "gyre/assets/tokenizer.json no longer matches what build_tokenizer.py builds; every machine uses the "
        "committed file, so only rebuild it (python -m gyre.model.build_tokenizer) on purpose")


def test_identity_identical_when_built_twice(tmp_path, tiny):
    other = ensure_tiny_model(tmp_path / "again")
    assert model_identity(other) == model_identity(tiny)
    assert model_identity(tiny)["name"] == "gyre-tiny-qwen"
    # The stored identity is what the files hash to.
    assert compute_identity(tiny)["model_hash"] == model_identity(tiny)["model_hash"]
    assert model_identity(tiny)["tokenizer_hash"] == hashlib.sha256(build_tokenizer.ASSET.read_bytes()).hexdigest()


def test_identity_changes_with_any_weight(tmp_path, tiny):
    import shutil

    from safetensors.torch import save_file

    copy = tmp_path / "copy"
    shutil.copytree(tiny, copy)
    tensors = load_file(str(copy / "model.safetensors"))
    tensors["model.norm.weight"][3] += 1e-3
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    assert compute_identity(copy)["model_hash"] != model_identity(tiny)["model_hash"]
    # A stale gyre_identity.json is only trusted when recompute is not asked for.
    assert model_identity(copy, recompute=True)["model_hash"] != model_identity(tiny)["model_hash"]


def test_ensure_is_idempotent(tiny):
    stamp = (tiny / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tiny) == tiny
    assert (tiny / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in tiny.parent.iterdir() if p.name.startswith(".tiny-qwen.")]  # no temp dir left


def test_model_shape_and_init(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    tok = load_tokenizer(tiny)
    assert cfg["model_type"] == "qwen2" and cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["vocab_size"] % 64 == 0 and cfg["vocab_size"] >= tok.get_vocab_size()
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (64, 2, 4, 2)
    assert cfg["tie_word_embeddings"] is False and cfg["max_position_embeddings"] == 32768
    assert cfg["eos_token_id"] == special_ids(tok)["<|im_end|>"]
    w = load_file(str(tiny / "model.safetensors"))
    assert "lm_head.weight" in w and not torch.equal(w["lm_head.weight"], w["model.embed_tokens.weight"])
    assert all(t.dtype == torch.float32 for t in w.values())
    # Not the tiny 0.02 default: attention must be far from uniform.
    assert w["model.layers.0.self_attn.q_proj.weight"].std() > 0.1
    assert (tiny / IDENTITY_FILE).exists() and (tiny / "tokenizer.json").exists()


def test_special_and_added_tokens(tiny):
    tok = load_tokenizer(tiny)
    ids = special_ids(tok)
    assert set(ids) == set(build_tokenizer.SPECIAL_TOKENS + build_tokenizer.ADDED_TOKENS)
    text = "<|im_start|>assistant\n<think>\nhm\n</think>\n<tool_call>\n{\"name\": \"bash\"}\n</tool_call><|im_end|>"
    enc = tok.encode(text).ids
    for t in ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"):
        assert ids[t] in enc, t  # each is one token, never split
    # Special tokens are dropped by skip_special_tokens; the tool/think tokens survive decoding.
    plain = tok.decode(enc, skip_special_tokens=True)
    assert "<|im_start|>" not in plain and "<tool_call>" in plain and "</think>" in plain
    assert tok.decode(enc, skip_special_tokens=False) == text


def test_decode_then_reencode_changes_ids(tiny):
    # A merged token sampled as its pieces decodes to the same text but re-encodes as one token.
    tok = load_tokenizer(tiny)
    merged = next(t for t, i in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
                  if len(t) >= 3 and t.isalpha() and tok.token_to_id(t[0]) is not None)
    pieces = [tok.token_to_id(c) for c in merged]
    assert None not in pieces
    text = tok.decode(pieces)
    assert tok.encode(text).ids != pieces
    assert tok.decode(tok.encode(text).ids) == text


def test_make_model_cli(tmp_path, capsys):
    from gyre.cli import main

    assert main(["make-model", "--out", str(tmp_path / "m")]) == 0
    assert "model_hash=" in capsys.readouterr().out
    assert (tmp_path / "m" / "model.safetensors").exists()
