_VALUES = [(1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),
           (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")]


def to_roman(n: int) -> str:
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"expected an int, got {type(n).__name__}")
    if not 1 <= n <= 3999:
        raise ValueError(f"{n} is outside 1..3999")
    out = []
    for value, letters in _VALUES:
        count, n = divmod(n, value)
        out.append(letters * count)
    return "".join(out)


_TABLE = {to_roman(n): n for n in range(1, 4000)}


def from_roman(s: str) -> int:
    try:
        return _TABLE[s.upper()]
    except (KeyError, AttributeError):
        raise ValueError(f"not a canonical Roman numeral: {s!r}") from None
