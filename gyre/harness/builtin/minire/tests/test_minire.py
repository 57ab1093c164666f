import pytest

from minire import PatternError, fullmatch, search

# (pattern, text, fullmatch expected), from the easiest to the hardest.
FULL = [
    ("abc", "abc", True),
    ("abc", "abd", False),
    ("a.c", "axc", True),
    ("a.c", "ac", False),
    ("ab*c", "ac", True),
    ("ab*c", "abbbc", True),
    (".*", "anything at all", True),
    ("ab+c", "ac", False),
    ("ab+c", "abbc", True),
    ("colou?r", "color", True),
    ("colou?r", "colouur", False),
    ("[abc]+", "cabbac", True),
    ("[a-z0-9]*", "abc123", True),
    ("[a-z]*", "abC", False),
    ("[^x]y", "zy", True),
    ("[^x]y", "xy", False),
    ("(ab)*", "ababab", True),
    ("(ab)*", "aba", False),
    ("cat|dog", "dog", True),
    ("a(b|c)*d", "abcbcd", True),
    ("(a|ab)(c|bcd)", "abcd", True),
    ("a{3}", "aaa", True),
    ("a{3}", "aa", False),
    ("a{2,}", "aaaaa", True),
    ("a{2,3}", "aaaa", False),
    ("(ab){1,2}c", "ababc", True),
    (r"\d+", "2024", True),
    (r"\w+\s\w+", "hello world", True),
    (r"\d", "x", False),
    (r"a\.b", "a.b", True),
    (r"a\.b", "axb", False),
    (r"\*+", "***", True),
    ("((a|b)(c|d)){2}", "acbd", True),
    ("(a*)*b", "aaab", True),
    ("(a|b)*abb", "babaabb", True),
    ("(x+x+)+y", "xxxxxxxxxxxxxxxxxxxxxxxxxxxx", False),
]


@pytest.mark.parametrize("pattern,text,expected", FULL)
def test_fullmatch(pattern, text, expected):
    assert fullmatch(pattern, text) is expected


SEARCH = [
    ("b", "abc", True),
    ("^b", "abc", False),
    ("c$", "abc", True),
    ("^a.*c$", "abc", True),
    ("b$", "abc", False),
    (r"\d{3}-\d{4}", "call 555-1234 now", True),
]


@pytest.mark.parametrize("pattern,text,expected", SEARCH)
def test_search(pattern, text, expected):
    assert search(pattern, text) is expected


@pytest.mark.parametrize("pattern", ["(ab", "ab)", "*a", "a**", "[ab", "ab\\", "a{3,1}"])
def test_invalid(pattern):
    with pytest.raises(PatternError):
        fullmatch(pattern, "")
