"""Build Gyre's embedded ChatML tokenizer offline and deterministically.

A byte-level BPE (vocabulary 2048) with Qwen's pre-tokenizer regex and Qwen's chat tokens:
``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` are *special* (dropped by
``decode(..., skip_special_tokens=True)``); ``<tool_call>``, ``</tool_call>``, ``<tool_response>``,
``</tool_response>``, ``<think>``, ``</think>`` are *added, non-special* tokens, so they survive
decoding like in Qwen's tokenizer. The training corpus is generated here from a seeded RNG, so
every machine builds the same ids. The result is committed as ``gyre/assets/tokenizer.json``;
run ``python -m gyre.engine.build_tokenizer [--out FILE] [--check]`` to rebuild or verify it.

Because it is a real BPE with merges, decoding generated ids and re-encoding the text often
gives other ids (e.g. ``'a'`` + ``'b'`` sampled separately re-encodes as ``'ab'``), which is the
situation Gyre's token-truth tests need.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from gyre.fsio import atomic_write_text

VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
ASSET = Path(__file__).resolve().parent.parent / "assets" / "tokenizer.json"

# Qwen2's pre-tokenizer split (digits one by one, words with one leading non-letter, ...).
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")

_WORDS = (
    "the of and to in is that for it as with was on be by this are from or an at not have which "
    "file test code function return value error run build install package module import class "
    "def self list dict string number true false none data path line output input result task "
    "repository agent model tool call response message user assistant system write read open close "
    "python pytest make command directory create update delete check fix bug pass fail step "
    "train policy reward token batch cache engine server request weight version cell node tree "
    "please let me first look at then we need should can will would could now next done"
).split()
_IDENTS = "foo bar baz qux items values count index total name args kwargs config parser main".split()
_TOOLS = ("bash", "read_file", "write_file", "search", "run_tests")


_ONSETS = "b c d f g h j k l m n p r s t v w z br cl dr fl gr pl st tr sh ch th".split()
_VOWELS = "a e i o u ai ea ou io".split()
_CODAS = ["", "", "n", "r", "s", "t", "l", "nd", "st", "ng", "ck"]
_LEXICON_SEED = 99


def _lexicon(n: int = 1500) -> list[str]:
    """Pseudo-words with a Zipf-like reuse, so BPE finds a wide range of merges."""
    rng = random.Random(_LEXICON_SEED)
    return ["".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                    for _ in range(rng.randint(1, 3))) for _ in range(n)]


_LEX = _lexicon()


def _word(rng: random.Random) -> str:
    if rng.random() < 0.6:
        return rng.choice(_WORDS)
    return _LEX[min(int(rng.paretovariate(0.9)) - 1, len(_LEX) - 1)] if rng.random() < 0.5 else rng.choice(_LEX)


def _sentence(rng: random.Random) -> str:
    words = [_word(rng) for _ in range(rng.randint(4, 14))]
    words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice([".", ".", "?", "!", ":"])


def _code(rng: random.Random) -> str:
    fn, a, b = rng.choice(_IDENTS), rng.choice(_IDENTS), _word(rng)
    n = rng.randint(0, 999)
    return rng.choice([
        f"def {fn}({a}, {b}=None):\n    return {a} + {n}\n",
        f"for {a} in range({n}):\n    {b}.append({a} * 2)\n",
        f"if {a} is None:\n    raise ValueError(\"{fn} missing {b}\")\n",
        f"import {fn}\nfrom {a}.{b} import {fn}_{n}\n",
        f"{a} = {{\"{b}\": {n}, \"{fn}\": [{n % 7}, {n % 11}]}}\n",
        f"$ pytest -q tests/test_{fn}.py\n{n} passed in 0.{n % 100}s\n",
    ])


def _tool_call(rng: random.Random) -> str:
    tool = rng.choice(_TOOLS)
    arg = {"command": f"ls -la {rng.choice(_IDENTS)}/"} if tool == "bash" else {"path": f"src/{rng.choice(_IDENTS)}.py"}
    call = json.dumps({"name": tool, "arguments": arg})
    return f"<tool_call>\n{call}\n</tool_call>"


def _conversation(rng: random.Random) -> str:
    parts = [f"<|im_start|>system\n{_sentence(rng)}<|im_end|>\n", f"<|im_start|>user\n{_sentence(rng)}<|im_end|>\n"]
    for _ in range(rng.randint(1, 3)):
        body = f"<think>\n{_sentence(rng)}\n</think>\n\n{_sentence(rng)}\n{_tool_call(rng)}"
        parts.append(f"<|im_start|>assistant\n{body}<|im_end|>\n")
        parts.append(f"<|im_start|>user\n<tool_response>\n{_code(rng)}</tool_response><|im_end|>\n")
    parts.append(f"<|im_start|>assistant\n{_sentence(rng)} {_code(rng)}<|im_end|><|endoftext|>")
    return "".join(parts)


def corpus(n_docs: int = 3000, seed: int = 1234) -> list[str]:
    """The deterministic training corpus: chat transcripts with thinking, tool calls and code."""
    rng = random.Random(seed)
    return [_conversation(rng) for _ in range(n_docs)]


def build() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # Special tokens first so they get ids 0..2 and are never split by the trainer.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(ADDED_TOKENS), min_frequency=2, show_progress=False,
        special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    return tok


def render(tok: Tokenizer) -> str:
    # tokenizers serialises vocab and merges in a fixed order, so equal builds give equal bytes.
    return tok.to_str(pretty=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ASSET, help=f"output file (default {ASSET})")
    p.add_argument("--check", action="store_true", help="verify the file equals a fresh build; exit 1 if not")
    args = p.parse_args(argv)
    text = render(build())
    if args.check:
        same = args.out.exists() and args.out.read_text(encoding="utf-8") == text
        print(f"{args.out}: {'up to date' if same else 'DIFFERS from a fresh build'}")
        return 0 if same else 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, text, mode=0o644)
    print(f"wrote {args.out} ({Tokenizer.from_str(text).get_vocab_size()} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
