"""Position: the one name of where the trainer stands (step, update), and nobody else's spelling of it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gyre.position import Position

GYRE = Path(__file__).resolve().parents[2] / "gyre"


@pytest.mark.parametrize("pos,name,key", [(Position(0), "v0", "0.0"), (Position(3), "v3", "3.0"),
                                          (Position(3, 2), "v3u2", "3.2"), (Position(12, 1), "v12u1", "12.1")])
def test_names_round_trip(pos, name, key):
    assert str(pos) == name and pos.key == key
    assert Position.parse(name) == pos and Position.parse(str(pos)) == pos


def test_order_is_step_then_update():
    order = [Position(0), Position(0, 1), Position(0, 2), Position(1), Position(1, 1), Position(2)]
    assert sorted(reversed(order)) == order
    assert sorted(Position.parse(str(p)) for p in reversed(order)) == order
    assert max(order) == Position(2) and Position(1, 5) < Position(2)


def test_after_final_and_inside():
    assert Position(3, 1).after(final=True) == Position(4)
    assert Position(3, 1).after(final=False) == Position(3, 2)
    assert Position(3).boundary and not Position(3, 1).boundary


@pytest.mark.parametrize("bad", ["v", "3", "v3u0", "v-1", "u2", "v3u", "v3x", "weights", "v3u2.tmp"])
def test_parse_refuses_other_names(bad):
    with pytest.raises(ValueError, match="not a position name"):
        Position.parse(bad)
    assert Position.of_name(bad) is None


@pytest.mark.parametrize("step,update", [(-1, 0), (0, -1), (1.5, 0), (True, 0), ("1", 0)])
def test_bad_values_refused(step, update):
    with pytest.raises(ValueError, match="Position"):
        Position(step, update)


# a directory name v<N> / v<N>u<k>, a regex reading one back, or a reduce key <step>.<update>
HAND_BUILT = re.compile(r"""f["']v\{|\}u\{|/\s*f["']v|v\(\\d\+\)|\{[\w.]*step\}\.\{[\w.]*update\}""")


def test_no_module_builds_position_names_by_hand():
    offenders = [f"{p.relative_to(GYRE.parent)}:{i}: {line.strip()}"
                 for p in sorted(GYRE.rglob("*.py")) if p.name != "position.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1) if HAND_BUILT.search(line)]
    assert not offenders, "build these names with gyre.position.Position:\n" + "\n".join(offenders)


def test_the_grep_catches_what_it_should():
    """The pattern above is not vacuous: each spelling the code used before Position matches."""
    for line in ['return str(self.ckpt_root / f"v{version}u{update}")', 'm = re.fullmatch(r"v(\\d+)(u\\d+)?", d.name)',
                 'return f"reduce/{step}.{update}/{members}/{attempt}"', 'self.weights_root / f"v{version}"']:
        assert HAND_BUILT.search(line), line
