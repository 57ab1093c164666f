import pytest

from wordcount import count_words, top_words


def test_basic():
    assert count_words("the cat and the hat") == {"the": 2, "cat": 1, "and": 1, "hat": 1}


def test_case_is_ignored():
    assert count_words("Go go GO") == {"go": 3}


def test_punctuation_separates():
    assert count_words("stop.Go!wait, (now)") == {"stop": 1, "go": 1, "wait": 1, "now": 1}


def test_digits_are_word_characters():
    assert count_words("route 66, route66") == {"route": 1, "66": 1, "route66": 1}


def test_inner_apostrophes():
    assert count_words("Don't stop rock'n'roll") == {"don't": 1, "stop": 1, "rock'n'roll": 1}


def test_outer_apostrophes_and_underscores():
    assert count_words("'quoted' snake_case") == {"quoted": 1, "snake": 1, "case": 1}


def test_unicode_letters():
    assert count_words("Café café naïve") == {"café": 2, "naïve": 1}


def test_empty():
    assert count_words("") == {}
    assert count_words(" ... !!! ") == {}


def test_top_words_order_and_ties():
    text = "b a c b a b d"
    assert top_words(text, 3) == [("b", 3), ("a", 2), ("c", 1)]


def test_top_words_more_than_available():
    assert top_words("x y x", 10) == [("x", 2), ("y", 1)]
    assert top_words("x y x", 0) == []


def test_top_words_negative():
    with pytest.raises(ValueError):
        top_words("a", -1)
