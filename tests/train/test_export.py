"""`gyre export`: a run's step as a transformers directory that transformers and Gyre's engine load
with the trainer's log-probs, for dense, MoE and hybrid families."""

from __future__ import annotations

import pytest

from gyre.batch import expanded_batch
from gyre.model.tiny import ensure_tiny_model

from support.export_run import PROMPT, batch, hf_logprobs, make_run

pytestmark = pytest.mark.slow  # a tiny model per family built, trained one step and exported

FAMILIES = ["qwen2", "qwen3_moe", "qwen3_5", "qwen3_next"]


@pytest.fixture(scope="module", params=FAMILIES)
def exported(request, tmp_path_factory):
    from gyre.cli import main

    family = request.param
    root = tmp_path_factory.mktemp(f"export-{family}")
    model_dir = ensure_tiny_model(root / "model", family)
    run, trainer = make_run(root, family, model_dir)
    out = root / "out"
    assert main(["export", str(run), str(out)]) == 0
    return family, run, trainer, out


def test_export_loads_in_transformers_with_the_trainers_logprobs(exported):
    family, run, trainer, out = exported
    got, want = hf_logprobs(out), trainer.logprobs(batch())
    assert (got - want).abs().max() < 1e-4, family
    assert (got - hf_logprobs(run.parent / "model")).abs().max() > 1e-3  # the trained step, not the model


def test_gyre_engine_serves_the_export_with_the_trainers_logprobs(exported):
    """The embedded engine (what `gyre engine --model OUT` serves) samples from the export; the
    behaviour log-probs it returns are the trainer's for the same tokens."""
    import asyncio

    from gyre.engine.client import EngineClient

    from support.inprocess_engine import InProcessEngine

    family, run, trainer, out = exported

    async def sample(url):
        async with EngineClient(url, api_key="k") as client:
            return await client.generate(PROMPT, {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 3,
                                                  "ignore_eos": True})

    with InProcessEngine(out, api_key="k") as eng:
        res = asyncio.run(sample(eng.url))
    mb = expanded_batch([PROMPT + res.output_ids], [len(PROMPT)], old_logprobs=[res.logprobs], advantages=[1.0],
                        execution_index=[0], temperature=1.0)
    assert (trainer.logprobs(mb) - mb.old_logprobs).abs().max() < 1e-4, family


def test_export_carries_tokenizer_chat_template_and_generation_config(exported):
    from transformers import AutoTokenizer, GenerationConfig

    family, run, trainer, out = exported
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "generation_config.json"} <= names
    tok = AutoTokenizer.from_pretrained(str(out))
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>"
    assert GenerationConfig.from_pretrained(str(out)).eos_token_id == tok.eos_token_id


def test_export_from_the_checkpoint_when_the_engine_export_is_gone(exported, tmp_path):
    import shutil

    from gyre.cli import main

    family, run, trainer, out = exported
    moved = tmp_path / "v1"
    shutil.move(run / "weights" / "v1", moved)  # retention removed the engines' copy
    try:
        assert main(["export", str(run), str(tmp_path / "again"), "--step", "1"]) == 0
    finally:
        shutil.move(moved, run / "weights" / "v1")
    assert (hf_logprobs(tmp_path / "again") - trainer.logprobs(batch())).abs().max() < 1e-4


def test_bad_requests_are_refused_with_one_line(tmp_path, capsys):
    from gyre.cli import main

    assert main(["export", str(tmp_path), str(tmp_path / "o")]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_a_step_past_the_run_or_gone_is_refused(exported, tmp_path, capsys):
    from gyre.cli import main

    family, run, trainer, out = exported
    if family != "qwen2":
        pytest.skip("one family suffices")
    assert main(["export", str(run), str(tmp_path / "a"), "--step", "5"]) == 2
    assert "committed 1 steps" in capsys.readouterr().err
    assert main(["export", str(run), str(out)]) == 2  # not empty: never overwritten
    assert "not empty" in capsys.readouterr().err
