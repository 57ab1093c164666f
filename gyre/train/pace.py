"""The paced trainer (``train.pace_tokens_per_s``, benchmarks only): a cell that trains at a stated rate.

The tiny CPU model trains a step's tokens in a second or two, and several cells training at once on
a 2-core machine share those cores, so live runs of it can neither give training a real share of
cell time nor show what a scheduler gains by training on more cells. With a pace, each micro-batch
a rank trains lasts at least its share of the cell's tokens at ``pace_tokens_per_s`` (the rank
sleeps what is left after its own compute): a cell trains at the stated rate, and k cells at k times
it, as the simulator's training pool assumes (``ClusterModel.train_rate``). Stated, not measured;
figures from paced runs say so. The reduce, the optimizer step and the weight export are not paced.
"""

from __future__ import annotations

import time


class TrainPacer:
    """Holds each micro-batch of a rank to `tokens x ranks / tokens_per_s` seconds: a rank trains
    1/ranks of the cell's rows, so the cell as a whole trains `tokens_per_s`. Counts micro-batches
    whose compute alone ran past the paced time (``overruns``: the CPU could not keep up)."""

    def __init__(self, tokens_per_s: float, ranks: int = 1, sleep=time.sleep, clock=time.monotonic) -> None:
        if tokens_per_s <= 0:
            raise ValueError(f"train.pace_tokens_per_s must be positive to pace, got {tokens_per_s}")
        if ranks < 1:
            raise ValueError(f"a cell has at least one trainer rank, got {ranks}")
        self.tokens_per_s, self.ranks = float(tokens_per_s), ranks
        self._sleep, self._clock = sleep, clock
        self.micro_batches = 0
        self.overruns = 0

    def start(self) -> float:
        return self._clock()

    def hold(self, t0: float, tokens: int) -> float:
        """The micro-batch that began at `t0` trained `tokens` on this rank: sleep out the rest of
        its paced time; returns that paced time."""
        target = tokens * self.ranks / self.tokens_per_s
        left = target - (self._clock() - t0)
        self.micro_batches += 1
        if left > 0:
            self._sleep(left)
        else:
            self.overruns += 1
        return target
