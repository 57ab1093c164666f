import re
from collections import Counter

_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)*")


def count_words(text: str) -> dict[str, int]:
    return dict(Counter(_WORD.findall(text.lower())))


def top_words(text: str, n: int) -> list[tuple[str, int]]:
    if n < 0:
        raise ValueError("n must not be negative")
    return sorted(count_words(text).items(), key=lambda kv: (-kv[1], kv[0]))[:n]
