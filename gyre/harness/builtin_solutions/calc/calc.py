import re


class CalcError(Exception):
    def __init__(self, message, position=None):
        super().__init__(message if position is None else f"{message} at {position}")
        self.position = position


_TOKEN = re.compile(r"\s*(?:(\d+\.\d*|\.\d+|\d+)|([A-Za-z_]\w*)|(\*\*|//|[-+*/%(),]))")
_FUNCS = {"abs": abs, "min": min, "max": max}


def _tokenize(expr):
    tokens, pos = [], 0
    while pos < len(expr):
        if expr[pos:].strip() == "":
            break
        m = _TOKEN.match(expr, pos)
        if not m:
            start = pos + len(expr[pos:]) - len(expr[pos:].lstrip())
            raise CalcError(f"unexpected character {expr[start]!r}", start)
        num, name, op = m.groups()
        start = m.start(m.lastindex)
        if num:
            tokens.append(("num", float(num) if "." in num else int(num), start))
        elif name:
            tokens.append(("name", name, start))
        else:
            tokens.append(("op", op, start))
        pos = m.end()
    tokens.append(("end", None, len(expr)))
    return tokens


class _Parser:
    def __init__(self, expr, variables):
        self.tokens, self.i, self.vars = _tokenize(expr), 0, variables

    def peek(self):
        return self.tokens[self.i]

    def take(self, op=None):
        tok = self.tokens[self.i]
        if op is not None and tok[1] != op:
            raise CalcError(f"expected {op!r}", tok[2])
        self.i += 1
        return tok

    def sum(self):
        value = self.product()
        while self.peek()[1] in ("+", "-") and self.peek()[0] == "op":
            op = self.take()[1]
            rhs = self.product()
            value = value + rhs if op == "+" else value - rhs
        return value

    def product(self):
        value = self.unary()
        while self.peek()[0] == "op" and self.peek()[1] in ("*", "/", "//", "%"):
            op = self.take()[1]
            rhs = self.unary()
            if op == "*":
                value *= rhs
                continue
            if rhs == 0:
                raise CalcError("division by zero")
            value = value / rhs if op == "/" else value // rhs if op == "//" else value % rhs
        return value

    def unary(self):
        if self.peek()[0] == "op" and self.peek()[1] in ("+", "-"):
            op = self.take()[1]
            value = self.unary()
            return -value if op == "-" else +value
        return self.power()

    def power(self):
        base = self.atom()
        if self.peek()[0] == "op" and self.peek()[1] == "**":
            self.take()
            return base ** self.unary()  # right associative; the exponent may carry a sign
        return base

    def atom(self):
        kind, value, pos = self.take()
        if kind == "num":
            return value
        if kind == "name":
            if self.peek()[1] == "(" and self.peek()[0] == "op":
                if value not in _FUNCS:
                    raise CalcError(f"unknown function {value!r}", pos)
                self.take("(")
                args = [self.sum()]
                while self.peek()[1] == ",":
                    self.take()
                    args.append(self.sum())
                self.take(")")
                return _FUNCS[value](*args) if value != "abs" or len(args) == 1 else abs(args[0])
            if value not in self.vars:
                raise CalcError(f"unknown variable {value!r}", pos)
            return self.vars[value]
        if value == "(":
            inner = self.sum()
            self.take(")")
            return inner
        raise CalcError("unexpected " + ("end of input" if kind == "end" else repr(value)), pos)


def evaluate(expr, variables=None):
    parser = _Parser(expr, variables or {})
    value = parser.sum()
    kind, tok, pos = parser.peek()
    if kind != "end":
        raise CalcError(f"unexpected {tok!r}", pos)
    return value
