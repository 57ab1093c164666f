"""DRAFT"""
from __future__ import annotations
import unicodedata
LEVELS = 10

def _chars(text):
    return [c for c in text if not c.isspace()]

def metric(kind, text):
    if kind == "brief":
        return float(len(text))
    cs = _chars(text)
    if not cs:
        return 0.0
    if kind == "digits":
        return sum(c.isdigit() for c in cs) / len(cs)
    if kind == "nonletter":
        return sum(not c.isalpha() for c in cs) / len(cs)
    raise KeyError(kind)

def level_passes(kind, text, level):
    m = metric(kind, text)
    if kind == "brief":
        return m <= 12 * (LEVELS + 1 - level)
    if kind == "digits":
        return m >= level / LEVELS
    if kind == "nonletter":
        return m >= 0.02 * level
    raise KeyError(kind)

def passed(kind, text):
    return sum(level_passes(kind, text, i) for i in range(1, LEVELS + 1))

def reward(kind, text):
    return passed(kind, text) / LEVELS
