"""Where the trainer stands in a run: `Position(step, update)`, one type for every name it takes.

``step`` is the number of optimizer steps completed (the policy version); ``update`` the optimizer
updates already applied inside the next step (``train.minibatches_per_step`` > 1), 0 at a step's
boundary. Positions order as (step, update). The same value names:

- a checkpoint or engine-export directory: ``v<step>`` at a boundary, ``v<step>u<update>`` inside
  a step (`str(pos)`, read back with `Position.parse`);
- a reduce attempt's store key: ``<step>.<update>`` (`pos.key`).

Ground floor: imports nothing of Gyre, so any module may take it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_NAME = re.compile(r"v(\d+)(?:u(\d+))?")


@dataclass(frozen=True, order=True)
class Position:
    step: int
    update: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ValueError(f"Position step {self.step!r}: a whole number >= 0 (the steps completed)")
        if isinstance(self.update, bool) or not isinstance(self.update, int) or self.update < 0:
            raise ValueError(f"Position update {self.update!r}: a whole number >= 0 (updates inside the step)")

    def __str__(self) -> str:
        return f"v{self.step}" if self.update == 0 else f"v{self.step}u{self.update}"

    @classmethod
    def parse(cls, name: str) -> "Position":
        """The position a directory name (``v3``, ``v3u1``) stands for; ValueError otherwise."""
        m = _NAME.fullmatch(name)
        if not m or (m[2] is not None and int(m[2]) == 0):
            raise ValueError(f"{name!r} is not a position name: expected v<step> or v<step>u<update> (update >= 1)")
        return cls(int(m[1]), int(m[2] or 0))

    @classmethod
    def of_name(cls, name: str) -> "Position | None":
        """`parse`, or None for a name that is not a position (other files beside checkpoints)."""
        try:
            return cls.parse(name)
        except ValueError:
            return None

    @property
    def boundary(self) -> bool:
        """At a step's boundary (no update of the next step applied yet)."""
        return self.update == 0

    @property
    def key(self) -> str:
        """The reduce/attempt store key of the update that starts here."""
        return f"{self.step}.{self.update}"

    def after(self, final: bool) -> "Position":
        """Where the trainer stands once the update starting here is applied: the next step's
        boundary when it was the step's last (``final``), else one update further in."""
        return Position(self.step + 1) if final else Position(self.step, self.update + 1)
