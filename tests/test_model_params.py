"""Parameter counts from a config (gyre.model.params) and `gyre plan --model-config`."""

from __future__ import annotations

import json

import pytest

from gyre.model import ModelFormatError
from gyre.model.params import param_counts
from gyre.train.toy import random_model, tiny_config

# Qwen3-30B-A3B's published architecture (model card: 30.5B total, 3.3B activated)
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                 "norm_topk_prob": True, "tie_word_embeddings": False, "rope_theta": 1000000.0,
                 "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "decoder_sparse_step": 1,
                 "mlp_only_layers": []}


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_moe", "qwen2_moe"])
def test_total_equals_the_transformers_model(family):
    hf = random_model(tiny_config(family, tie_word_embeddings=family == "qwen3"), seed=0)
    counts = param_counts(hf.config.to_dict())
    assert counts["total"] == sum(p.numel() for p in hf.parameters())
    assert counts["active"] <= counts["total"]
    assert (counts["expert"] > 0) == family.endswith("moe")


def test_a_real_moe_config_matches_its_model_card(tmp_path):
    counts = param_counts(QWEN3_30B_A3B)
    assert 30.3e9 < counts["total"] < 30.7e9
    assert 3.2e9 < counts["active"] < 3.4e9
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    assert param_counts(tmp_path) == counts  # a directory or its config.json
    with pytest.raises(ModelFormatError, match="missing or bad field"):
        param_counts({k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts_per_tok"})


def test_plan_takes_a_model_config(tmp_path):
    import argparse

    from gyre.config import ConfigError
    from gyre.sim import plan

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    parser = argparse.ArgumentParser()
    plan.add_arguments(parser)
    args = parser.parse_args(["--model-config", str(tmp_path / "config.json"), "--nodes", "8", "--cell-nodes", "4",
                              "--schemes", "E", "--staleness", "0", "--steps", "2"])
    runs = plan.scenarios(args)
    base = plan.scenarios(parser.parse_args(["--nodes", "8", "--cell-nodes", "4", "--schemes", "E",
                                             "--staleness", "0", "--steps", "2"]))
    # the FLOP arithmetic follows the config: attention in all 48 layers (4096 wide) vs the preset's
    # 12 full-attention layers, 3.3B active instead of 10B
    counts = param_counts(QWEN3_30B_A3B)
    rep = runs[0].cluster.replica
    assert rep.active_params == counts["active"] and rep.attn_flops_per_ctx_token == 4 * 48 * 32 * 128
    assert (rep.experts, rep.topk) == (128, 8) and rep.kv_bytes_per_token == 48 * 2 * 4 * 128 * 2
    assert rep.dense_gb + rep.expert_gb == pytest.approx(counts["total"] / 1e9)  # FP8: a byte a parameter
    assert runs[0].cluster.train_tokens_per_s != pytest.approx(base[0].cluster.train_tokens_per_s, rel=0.05)
    p = plan.with_model_config(plan.preset(args.preset), tmp_path)
    assert p.model.params == param_counts(QWEN3_30B_A3B)["total"] and p.model.replica_gpus == 1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="--model-config: .*supported families"):
        plan.scenarios(parser.parse_args(["--model-config", str(bad)]))
