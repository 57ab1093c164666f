import pytest

from calc import CalcError, evaluate

# From the easiest to the hardest.
CASES = [
    ("42", 42),
    ("1 + 2", 3),
    ("7 - 10", -3),
    ("2 * 3 + 4", 10),
    ("2 + 3 * 4", 14),
    ("(2 + 3) * 4", 20),
    ("10 / 4", 2.5),
    ("7 // 2", 3),
    ("-7 // 2", -4),
    ("7 % 3", 1),
    ("3.5 + .5", 4.0),
    ("-3", -3),
    ("--3", 3),
    ("2 ** 10", 1024),
    ("2 ** 3 ** 2", 512),
    ("-2 ** 2", -4),
    ("(-2) ** 2", 4),
    ("2 ** -1", 0.5),
    ("1 - 2 - 3", -4),
    ("100 / 10 / 5", 2.0),
    ("((((1))))", 1),
    ("abs(-5) + max(1, 7, 3) - min(4, 2)", 10),
    ("max(2 * 3, 2 ** 3)", 8),
]


@pytest.mark.parametrize("expr,value", CASES)
def test_values(expr, value):
    result = evaluate(expr)
    assert result == value and type(result) is type(value)


def test_variables():
    assert evaluate("x * y + z_1", {"x": 3, "y": 4, "z_1": 1}) == 13


def test_whitespace():
    assert evaluate(" \t1+\n2 ") == 3


@pytest.mark.parametrize("expr,position", [
    ("1 + ", 4),
    ("1 + $", 4),
    ("1 2", 2),
    ("(1 + 2", 6),
    ("1 + 2)", 5),
    ("", 0),
    ("foo + 1", 0),
    ("2 * nope(3)", 4),
])
def test_errors_with_position(expr, position):
    with pytest.raises(CalcError) as info:
        evaluate(expr)
    assert info.value.position == position


@pytest.mark.parametrize("expr", ["1 / 0", "1 // 0", "5 % 0"])
def test_division_by_zero(expr):
    with pytest.raises(CalcError) as info:
        evaluate(expr)
    assert info.value.position is None


def test_no_eval():
    with pytest.raises(CalcError):
        evaluate("__import__('os')")
