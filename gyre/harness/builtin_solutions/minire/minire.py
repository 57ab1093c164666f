"""A set-of-positions regular-expression matcher: each node maps a start position to the set of
positions where it can end, so there is no exponential backtracking."""


class PatternError(ValueError):
    pass


_CLASSES = {"d": str.isdigit, "w": lambda c: c.isalnum() or c == "_", "s": str.isspace}


class _Parser:
    def __init__(self, pattern):
        self.p, self.i = pattern, 0

    def more(self):
        return self.i < len(self.p)

    def peek(self):
        return self.p[self.i] if self.more() else None

    def alternation(self):
        branches = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.sequence())
        return ("alt", branches)

    def sequence(self):
        items = []
        while self.more() and self.peek() not in "|)":
            items.append(self.repeat(self.atom()))
        return ("seq", items)

    def repeat(self, node):
        while self.peek() in ("*", "+", "?", "{"):
            c = self.p[self.i]
            self.i += 1
            if c == "*":
                lo, hi = 0, None
            elif c == "+":
                lo, hi = 1, None
            elif c == "?":
                lo, hi = 0, 1
            else:
                lo, hi = self.counts()
            if node[0] == "rep":
                raise PatternError(f"multiple repeat at {self.i - 1}")
            node = ("rep", node, lo, hi)
        return node

    def counts(self):
        end = self.p.find("}", self.i)
        if end < 0:
            raise PatternError("unterminated {")
        body, self.i = self.p[self.i:end], end + 1
        lo, sep, hi = body.partition(",")
        try:
            lo_n = int(lo)
            hi_n = (None if hi == "" else int(hi)) if sep else lo_n
        except ValueError:
            raise PatternError(f"bad repetition {{{body}}}") from None
        if hi_n is not None and hi_n < lo_n:
            raise PatternError(f"bad repetition {{{body}}}")
        return lo_n, hi_n

    def atom(self):
        c = self.p[self.i]
        self.i += 1
        if c == "(":
            inner = self.alternation()
            if self.peek() != ")":
                raise PatternError("missing )")
            self.i += 1
            return inner
        if c in "*+?{":
            raise PatternError(f"nothing to repeat at {self.i - 1}")
        if c == ".":
            return ("pred", lambda ch: True)
        if c == "^":
            return ("bol",)
        if c == "$":
            return ("eol",)
        if c == "[":
            return self.klass()
        if c == "\\":
            return ("pred", self.escape())
        return ("pred", lambda ch, c=c: ch == c)

    def escape(self):
        if not self.more():
            raise PatternError("trailing backslash")
        c = self.p[self.i]
        self.i += 1
        return _CLASSES.get(c) or (lambda ch, c=c: ch == c)

    def klass(self):
        negate = self.peek() == "^"
        self.i += negate
        tests, first = [], True
        while True:
            if not self.more():
                raise PatternError("unterminated [")
            c = self.p[self.i]
            self.i += 1
            if c == "]" and not first:
                break
            first = False
            if c == "\\":
                tests.append(self.escape())
            elif self.peek() == "-" and self.i + 1 < len(self.p) and self.p[self.i + 1] != "]":
                lo, hi = c, self.p[self.i + 1]
                self.i += 2
                tests.append(lambda ch, lo=lo, hi=hi: lo <= ch <= hi)
            else:
                tests.append(lambda ch, c=c: ch == c)
        return ("pred", lambda ch: any(t(ch) for t in tests) != negate)


def _compile(pattern):
    parser = _Parser(pattern)
    node = parser.alternation()
    if parser.more():
        raise PatternError(f"unbalanced ) at {parser.i}")
    return node


def _ends(node, text, starts):
    """All positions where `node` can end when it starts at any of `starts`."""
    kind = node[0]
    if kind == "pred":
        return {i + 1 for i in starts if i < len(text) and node[1](text[i])}
    if kind == "bol":
        return {i for i in starts if i == 0}
    if kind == "eol":
        return {i for i in starts if i == len(text)}
    if kind == "seq":
        for item in node[1]:
            starts = _ends(item, text, starts)
        return starts
    if kind == "alt":
        return set().union(*(_ends(b, text, starts) for b in node[1]))
    _, inner, lo, hi = node
    current, result, count = set(starts), set(), 0
    seen = set()
    while current:
        if count >= lo:
            result |= current
        if hi is not None and count == hi:
            break
        current = _ends(inner, text, current)
        count += 1
        if count > lo:  # past the minimum, positions already tried add nothing new
            current -= seen
            seen |= current
    return result


def fullmatch(pattern, text):
    return len(text) in _ends(_compile(pattern), text, {0})


def search(pattern, text):
    return bool(_ends(_compile(pattern), text, set(range(len(text) + 1))))
