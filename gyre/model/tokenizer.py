"""A model directory's tokenizer (``tokenizer.json``, read with `tokenizers`, no transformers)."""

from __future__ import annotations

import os
from pathlib import Path

from tokenizers import Tokenizer

from gyre.model.build_tokenizer import ADDED_TOKENS, SPECIAL_TOKENS


def load_tokenizer(model_dir: str | os.PathLike) -> Tokenizer:
    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))


def special_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """Token text -> id for the ChatML special tokens and the added tool/think tokens present."""
    out = {}
    for text in SPECIAL_TOKENS + ADDED_TOKENS:
        tid = tokenizer.token_to_id(text)
        if tid is not None:
            out[text] = tid
    return out
