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

# Qwen3-Next-80B-A3B's published config.json (model card: 80B total, 3B activated; 48 layers,
# full attention every fourth)
QWEN3_NEXT_80B = {"model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5120,
                  "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_hidden_layers": 48,
                  "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "num_experts": 512,
                  "num_experts_per_tok": 10, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                  "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
                  "partial_rotary_factor": 0.25, "rope_theta": 10000000, "tie_word_embeddings": False,
                  "max_position_embeddings": 262144, "rms_norm_eps": 1e-6}


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "qwen3_next", "qwen3_5",
                                    "qwen3_5_moe"])
def test_total_equals_the_transformers_model(family):
    hf = random_model(tiny_config(family, tie_word_embeddings=family == "qwen3"), seed=0)
    counts = param_counts(hf.config.to_dict())
    assert counts["total"] == sum(p.numel() for p in hf.parameters())
    assert counts["active"] <= counts["total"]
    assert (counts["expert"] > 0) == (family.endswith("moe") or family == "qwen3_next")


def test_a_real_moe_config_matches_its_model_card(tmp_path):
    counts = param_counts(QWEN3_30B_A3B)
    assert 30.3e9 < counts["total"] < 30.7e9
    assert 3.2e9 < counts["active"] < 3.4e9
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    assert param_counts(tmp_path) == counts  # a directory or its config.json
    with pytest.raises(ModelFormatError, match="missing or bad field"):
        param_counts({k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts_per_tok"})


def test_a_hybrid_counts_kv_for_full_attention_layers_and_a_state_for_the_linear_ones():
    from gyre.sim.calibration import GDN_STATE_BYTES

    counts = param_counts(QWEN3_NEXT_80B)
    assert 79e9 < counts["total"] < 82e9
    # the card's "3B activated" leaves out the embedding and the untied head (2 x 0.31B)
    assert 3.0e9 < counts["active"] - 2 * counts["embedding"] < 3.4e9
    assert counts["attn_layers"] == 12 and counts["kv_bytes_per_token"] == 12 * 2 * 2 * 256 * 2
    assert counts["state_bytes_per_request"] == 36 * GDN_STATE_BYTES  # the presets' per-layer figure
    # the multimodal Qwen3.5 layout nests the text model's config
    nested = {"model_type": "qwen3_5_moe", "text_config": {**QWEN3_NEXT_80B, "model_type": "qwen3_5_moe_text"}}
    assert param_counts(nested)["state_bytes_per_request"] == counts["state_bytes_per_request"]
    assert param_counts(QWEN3_30B_A3B)["state_bytes_per_request"] == 0


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
    (tmp_path / "next.json").write_text(json.dumps(QWEN3_NEXT_80B))
    hybrid = plan.scenarios(parser.parse_args(["--model-config", str(tmp_path / "next.json"), "--nodes", "8",
                                               "--cell-nodes", "4", "--schemes", "E", "--staleness", "0",
                                               "--steps", "2"]))[0].cluster
    c = param_counts(QWEN3_NEXT_80B)
    rep = hybrid.replica
    assert rep.kv_bytes_per_token == c["kv_bytes_per_token"] and rep.attn_flops_per_ctx_token == 4 * 12 * 16 * 256
    assert rep.state_bytes_per_request == c["state_bytes_per_request"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="--model-config: .*supported families"):
        plan.scenarios(parser.parse_args(["--model-config", str(bad)]))
