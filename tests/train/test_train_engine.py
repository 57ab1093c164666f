"""Engine and trainer agree on log-probs, before and after a step exported and pushed to the engine.

This is the end-to-end check of token truth: the engine samples (recording behaviour log-probs),
the trainer recomputes them from the same tokens, trains, exports in the engine's layout, the
engine loads it through `/update_weights_from_disk`, and the two agree again.
"""

import asyncio

import pytest
import torch

from gyre.batch import expanded_batch
from gyre.config import TrainConfig
from gyre.train.backends import make_trainer
from gyre.engine.sglang_api import SGLangAdmin

from support.inprocess_engine import InProcessEngine

pytestmark = pytest.mark.slow  # an engine subprocess and a tiny model built from scratch

TEMPERATURE = 0.8
PROMPTS = [[11, 12, 13, 14, 15], [21, 22, 23]]


@pytest.fixture(scope="module", params=["qwen2", "qwen3_moe"])
def engine(tmp_path_factory, request):
    from gyre.model.tiny import ensure_tiny_model

    model_dir = ensure_tiny_model(tmp_path_factory.mktemp("engine") / "tiny", request.param)
    with InProcessEngine(model_dir, api_key="k") as eng:
        eng.model_dir = model_dir
        yield eng


def sample(engine, seed):
    from gyre.engine.client import EngineClient

    async def run():
        async with EngineClient(engine.url, api_key="k") as client:
            params = {"max_new_tokens": 10, "temperature": TEMPERATURE, "sampling_seed": seed,
                      "ignore_eos": True}
            return await asyncio.gather(*(client.generate(p, params) for p in PROMPTS))

    results = asyncio.run(run())
    batch = expanded_batch([p + r.output_ids for p, r in zip(PROMPTS, results)],
                           [len(p) for p in PROMPTS], old_logprobs=[r.logprobs for r in results],
                           advantages=[1.0, -1.0], execution_index=[0, 1], temperature=TEMPERATURE)
    return batch, {r.weight_version for r in results}


@pytest.mark.parametrize("backend", ["embedded", "megatron"])
def test_engine_and_trainer_logprobs_agree_across_a_weight_push(engine, backend, tmp_path):
    # start from the initial weights whatever an earlier test pushed
    SGLangAdmin(engine.url, "k").update_weights_from_disk(str(engine.model_dir), "0")  # as the cell agent does
    mb, versions = sample(engine, seed=1)
    assert mb.num_targets == 20 and versions == {"0"}
    trainer = make_trainer(TrainConfig(backend=backend, lr=1e-3, dtype="float32"), engine.model_dir)
    assert torch.allclose(trainer.logprobs(mb), mb.old_logprobs, atol=1e-4)

    trainer.forward_backward(mb)
    trainer.optimizer_step()
    version = f"{backend}-1"
    out = trainer.export_weights(tmp_path / "w1", weight_version=version)
    SGLangAdmin(engine.url, "k").update_weights_from_disk(str(out), version)

    mb2, versions = sample(engine, seed=2)
    assert versions == {version}
    new = trainer.logprobs(mb2)
    assert torch.allclose(new, mb2.old_logprobs, atol=1e-4)
    # the engine really serves the trained weights: the old weights disagree with what it sampled
    before = make_trainer(TrainConfig(backend="embedded", dtype="float32"), engine.model_dir)
    assert (before.logprobs(mb2) - mb2.old_logprobs).abs().max() > 1e-3
