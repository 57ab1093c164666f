import pytest

from fizzbuzz import fizzbuzz, fizzbuzz_range


def test_plain_numbers():
    assert [fizzbuzz(n) for n in (1, 2, 4, 7, 98)] == ["1", "2", "4", "7", "98"]


def test_fizz():
    assert [fizzbuzz(n) for n in (3, 6, 9, 99)] == ["Fizz"] * 4


def test_buzz():
    assert [fizzbuzz(n) for n in (5, 10, 20, 100)] == ["Buzz"] * 4


def test_fizzbuzz():
    assert [fizzbuzz(n) for n in (15, 30, 45, 150)] == ["FizzBuzz"] * 4


@pytest.mark.parametrize("n", [0, -3, -15])
def test_invalid(n):
    with pytest.raises(ValueError):
        fizzbuzz(n)


def test_range():
    assert fizzbuzz_range(1, 16) == ["1", "2", "Fizz", "4", "Buzz", "Fizz", "7", "8", "Fizz", "Buzz",
                                     "11", "Fizz", "13", "14", "FizzBuzz"]


def test_range_empty():
    assert fizzbuzz_range(5, 5) == []
    assert fizzbuzz_range(9, 2) == []
