from fractions import Fraction

import pytest

from matrix import Matrix


def test_shape_and_index():
    m = Matrix([[1, 2, 3], [4, 5, 6]])
    assert m.shape == (2, 3) and m[1, 2] == 6


@pytest.mark.parametrize("rows", [[], [[]], [[1, 2], [3]]])
def test_invalid(rows):
    with pytest.raises(ValueError):
        Matrix(rows)


def test_rows_are_copied():
    rows = [[1, 2], [3, 4]]
    m = Matrix(rows)
    rows[0][0] = 99
    m.rows[0][0] = 98
    assert m[0, 0] == 1


def test_add_sub_neg():
    a, b = Matrix([[1, 2], [3, 4]]), Matrix([[10, 20], [30, 40]])
    assert a + b == Matrix([[11, 22], [33, 44]])
    assert b - a == Matrix([[9, 18], [27, 36]])
    assert -a == Matrix([[-1, -2], [-3, -4]])
    with pytest.raises(ValueError):
        a + Matrix([[1, 2, 3]])


def test_product():
    a = Matrix([[1, 2, 3], [4, 5, 6]])
    b = Matrix([[7, 8], [9, 10], [11, 12]])
    assert a * b == Matrix([[58, 64], [139, 154]])
    with pytest.raises(ValueError):
        a * a


def test_scalar():
    a = Matrix([[1, 2], [3, 4]])
    assert a * 3 == Matrix([[3, 6], [9, 12]]) == 3 * a


def test_transpose_identity():
    a = Matrix([[1, 2, 3], [4, 5, 6]])
    assert a.transpose() == Matrix([[1, 4], [2, 5], [3, 6]])
    assert Matrix.identity(2) == Matrix([[1, 0], [0, 1]])
    assert a * Matrix.identity(3) == a


@pytest.mark.parametrize("rows,det", [
    ([[7]], 7),
    ([[1, 2], [3, 4]], -2),
    ([[2, 0, 1], [1, 3, 2], [1, 1, 2]], 6),
    ([[0, 1], [1, 0]], -1),
    ([[1, 2], [2, 4]], 0),
    ([[6, 1, 1, 3], [4, -2, 5, 1], [2, 8, 7, 6], [3, 1, 9, 7]], -1309),
])
def test_determinant(rows, det):
    d = Matrix(rows).determinant()
    assert d == det and isinstance(d, int)


def test_determinant_not_square():
    with pytest.raises(ValueError):
        Matrix([[1, 2]]).determinant()


def test_inverse():
    a = Matrix([[4, 7], [2, 6]])
    inv = a.inverse()
    assert inv[0, 0] == Fraction(3, 5) and inv[1, 0] == Fraction(-1, 5)
    assert a * inv == Matrix.identity(2)


def test_inverse_singular():
    with pytest.raises(ValueError):
        Matrix([[1, 2], [2, 4]]).inverse()


def test_repr():
    assert repr(Matrix([[1, 2], [3, 4]])) == "Matrix([[1, 2], [3, 4]])"
