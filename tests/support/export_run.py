"""A run directory after one trained step (what `gyre export` reads) and transformers' own
log-probs of a fixed response: for tests/train/test_export.py and benchmarks/bench_checkpoints.py."""

from __future__ import annotations

import json

import torch

from gyre.batch import expanded_batch
from gyre.config import GyreConfig, TrainConfig

PROMPT, RESPONSE = [11, 12, 13, 14, 15], [40, 41, 42, 43, 44, 45, 46]


def batch():
    seq = PROMPT + RESPONSE
    return expanded_batch([seq], [len(PROMPT)], old_logprobs=[[0.0] * len(RESPONSE)], advantages=[1.0],
                          execution_index=[0], temperature=1.0)


def make_run(root, family, model_dir):
    """A run directory as `gyre run` leaves it after one step: config.toml, state.json, the
    engines' export and the trainer checkpoint of step 1 (written as the leader rank writes them)."""
    from gyre.report import config_file
    from gyre.train.backends import make_trainer
    from gyre.train.export import export_pieces

    run = root / "run"
    run.mkdir()
    cfg = GyreConfig()
    cfg.run.dir, cfg.model.path, cfg.model.tiny_family = str(run), str(model_dir), family
    cfg.train.dtype = "float32"
    config_file.write(cfg, run)
    trainer = make_trainer(TrainConfig(dtype="float32", lr=1e-2), model_dir)
    mb = batch()
    mb.old_logprobs = trainer.logprobs(mb)
    trainer.forward_backward(mb)
    trainer.optimizer_step()  # trained weights, not the model's
    export_pieces(trainer.hf_state_dict(), trainer.hf_config, run / "weights" / "v1", 1)
    trainer.save_checkpoint(run / "checkpoints" / "v1")
    (run / "state.json").write_text(json.dumps({"version": 1, "rollout_version": 1, "groups_started": 2}))
    return run, trainer


def hf_logprobs(model_dir) -> torch.Tensor:
    """Log-probs of RESPONSE after PROMPT by transformers itself (its own forward, not Gyre's)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT + RESPONSE])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(PROMPT) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(RESPONSE)[:, None])[:, 0]
