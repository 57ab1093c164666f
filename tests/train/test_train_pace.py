"""train.pace_tokens_per_s: a paced cell trains at the stated rate, however many ranks share it.

No wall-clock assertions: the pacer runs on a virtual clock (compute takes the time a test says,
each sleep advances the clock), so what is checked is how long each micro-batch is held."""

from __future__ import annotations

import pytest

from gyre.config import ConfigError, load_config
from gyre.train.pace import TrainPacer


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def pacer(rate: float, ranks: int = 1) -> tuple[TrainPacer, Clock]:
    c = Clock()
    return TrainPacer(rate, ranks, sleep=c.sleep, clock=lambda: c.now), c


def test_a_micro_batch_lasts_its_tokens_at_the_rate_less_its_own_compute():
    p, c = pacer(500.0)
    t0 = p.start()
    c.now += 0.3  # the forward/backward itself
    assert p.hold(t0, 1000) == pytest.approx(2.0)
    assert c.now == pytest.approx(2.0)
    assert c.slept == [pytest.approx(1.7)]
    assert (p.micro_batches, p.overruns) == (1, 0)


def test_each_rank_holds_its_share_so_the_cell_trains_at_the_rate():
    # two data-parallel ranks, each with half of a 1000-token micro-batch: each lasts 1000 / 500 s
    p, c = pacer(500.0, ranks=2)
    t0 = p.start()
    assert p.hold(t0, 500) == pytest.approx(2.0)
    assert c.now == pytest.approx(2.0)


def test_compute_slower_than_the_pace_is_counted_not_slept():
    p, c = pacer(1000.0)
    t0 = p.start()
    c.now += 0.5  # 100 tokens should take 0.1 s
    p.hold(t0, 100)
    assert c.slept == [] and p.overruns == 1


@pytest.mark.parametrize("rate, ranks", [(0.0, 1), (-5.0, 1), (100.0, 0)])
def test_a_pacer_without_a_rate_or_ranks_is_refused(rate, ranks):
    with pytest.raises(ValueError, match="pace_tokens_per_s|trainer rank"):
        TrainPacer(rate, ranks)


def test_the_config_default_is_unpaced_and_a_negative_rate_is_refused():
    assert load_config(None, []).train.pace_tokens_per_s == 0.0
    assert load_config(None, ["train.pace_tokens_per_s=400"]).train.pace_tokens_per_s == 400.0
    with pytest.raises(ConfigError, match="pace_tokens_per_s"):
        load_config(None, ["train.pace_tokens_per_s=-1"])


def test_a_rank_holds_each_micro_batch_it_trains_to_the_pace():
    """The seam in gyre.cell.trainer_rank: the rank's forward_backward is held to the tokens its trainer
    reports; without a pacer nothing is held."""
    from types import SimpleNamespace

    from gyre.batch import expanded_batch, to_wire
    from gyre.cell.trainer_messages import ForwardBackward
    from gyre.cell.trainer_rank import Rank

    mb = expanded_batch([[1, 2, 3, 4]], [2], old_logprobs=[[-1.0, -1.0]], advantages=[1.0], execution_index=[0])
    msg = ForwardBackward(wire_mb=to_wire(mb))
    trained = []
    trainer = SimpleNamespace(forward_backward=lambda m: trained.append(m) or {"tokens": 400})
    p, c = pacer(200.0)
    rank = SimpleNamespace(_new_step=lambda step, update: None, dp_rank=0, dp_size=1, trainer=trainer, pacer=p)
    assert Rank.forward_backward(rank, msg) == {"tokens": 400}
    assert c.now == pytest.approx(2.0) and p.micro_batches == 1
    rank.pacer = None
    Rank.forward_backward(rank, msg)
    assert len(trained) == 2 and c.now == pytest.approx(2.0)
