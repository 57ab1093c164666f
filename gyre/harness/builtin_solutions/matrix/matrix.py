from fractions import Fraction
from numbers import Number


def _exact(x):
    return int(x) if isinstance(x, Fraction) and x.denominator == 1 else x


class Matrix:
    def __init__(self, rows):
        if not rows or not rows[0] or any(len(r) != len(rows[0]) for r in rows):
            raise ValueError("a matrix needs equally long, non-empty rows")
        self._rows = [list(r) for r in rows]

    @property
    def shape(self):
        return len(self._rows), len(self._rows[0])

    @property
    def rows(self):
        return [list(r) for r in self._rows]

    @classmethod
    def identity(cls, n):
        return cls([[int(i == j) for j in range(n)] for i in range(n)])

    def __getitem__(self, ij):
        i, j = ij
        return self._rows[i][j]

    def __eq__(self, other):
        return isinstance(other, Matrix) and self._rows == other._rows

    def _same_shape(self, other):
        if self.shape != other.shape:
            raise ValueError(f"shapes differ: {self.shape} and {other.shape}")

    def __add__(self, other):
        self._same_shape(other)
        return Matrix([[a + b for a, b in zip(r, s)] for r, s in zip(self._rows, other._rows)])

    def __neg__(self):
        return self * -1

    def __sub__(self, other):
        return self + (-other)

    def __mul__(self, other):
        if isinstance(other, Number):
            return Matrix([[a * other for a in r] for r in self._rows])
        if self.shape[1] != other.shape[0]:
            raise ValueError(f"cannot multiply {self.shape} by {other.shape}")
        cols = list(zip(*other._rows))
        return Matrix([[sum(a * b for a, b in zip(r, c)) for c in cols] for r in self._rows])

    def __rmul__(self, other):
        return self * other

    def transpose(self):
        return Matrix([list(c) for c in zip(*self._rows)])

    def _square(self):
        if self.shape[0] != self.shape[1]:
            raise ValueError("the matrix is not square")

    def determinant(self):
        self._square()
        m = [[Fraction(x) for x in r] for r in self._rows]
        n, det = len(m), Fraction(1)
        for col in range(n):
            pivot = next((r for r in range(col, n) if m[r][col] != 0), None)
            if pivot is None:
                return 0
            if pivot != col:
                m[col], m[pivot] = m[pivot], m[col]
                det = -det
            det *= m[col][col]
            for r in range(col + 1, n):
                f = m[r][col] / m[col][col]
                m[r] = [a - f * b for a, b in zip(m[r], m[col])]
        return _exact(det)

    def inverse(self):
        self._square()
        n = self.shape[0]
        m = [[Fraction(x) for x in r] + [Fraction(int(i == j)) for j in range(n)]
             for i, r in enumerate(self._rows)]
        for col in range(n):
            pivot = next((r for r in range(col, n) if m[r][col] != 0), None)
            if pivot is None:
                raise ValueError("the matrix is singular")
            m[col], m[pivot] = m[pivot], m[col]
            p = m[col][col]
            m[col] = [x / p for x in m[col]]
            for r in range(n):
                if r != col and m[r][col] != 0:
                    f = m[r][col]
                    m[r] = [a - f * b for a, b in zip(m[r], m[col])]
        return Matrix([[_exact(x) for x in r[n:]] for r in m])

    def __repr__(self):
        return f"Matrix({self._rows!r})"
