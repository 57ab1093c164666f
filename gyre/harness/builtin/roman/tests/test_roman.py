import pytest

from roman import from_roman, to_roman

PAIRS = [(1, "I"), (3, "III"), (4, "IV"), (9, "IX"), (14, "XIV"), (40, "XL"), (90, "XC"),
         (400, "CD"), (944, "CMXLIV"), (1994, "MCMXCIV"), (2024, "MMXXIV"), (3999, "MMMCMXCIX")]


@pytest.mark.parametrize("n,s", PAIRS)
def test_to_roman(n, s):
    assert to_roman(n) == s


@pytest.mark.parametrize("n,s", PAIRS)
def test_from_roman(n, s):
    assert from_roman(s) == n


def test_lower_case():
    assert from_roman("xiv") == 14
    assert from_roman("mCmXcIv") == 1994


@pytest.mark.parametrize("n", [0, -1, 4000])
def test_to_roman_out_of_range(n):
    with pytest.raises(ValueError):
        to_roman(n)


@pytest.mark.parametrize("n", [1.0, "5", True])
def test_to_roman_type(n):
    with pytest.raises(TypeError):
        to_roman(n)


@pytest.mark.parametrize("s", ["", "ABC", "IIII", "VV", "IC", "XM", "MMMM", "IIV", "VX", "LL", "DM", "XIIII"])
def test_from_roman_invalid(s):
    with pytest.raises(ValueError):
        from_roman(s)


def test_round_trip():
    for n in range(1, 4000):
        assert from_roman(to_roman(n)) == n
