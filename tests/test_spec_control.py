"""The adaptive speculation controller, driven with synthetic step timings."""

from __future__ import annotations

from ember_engine.spec.spec_control import SpecController, bucket_of, updated_acceptance


def drive(controller: SpecController, batch: int, steps: int, on_rate: float, off_rate: float) -> list[int]:
    """Run `steps` decisions; a step yields tokens at `on_rate` or `off_rate` tokens/s. Returns the Ks."""
    ks = []
    for _ in range(steps):
        k = controller.lookahead(batch)
        ks.append(k)
        controller.record(batch, k > 0, tokens=100, seconds=100 / (on_rate if k else off_rate))
    return ks


def test_speculation_stays_on_where_it_pays_and_off_where_it_does_not() -> None:
    c = SpecController(4, explore_every=20)
    small = drive(c, batch=1, steps=200, on_rate=300.0, off_rate=100.0)
    large = drive(c, batch=64, steps=200, on_rate=800.0, off_rate=1000.0)
    assert sum(k > 0 for k in small[10:]) / len(small[10:]) >= 0.9
    assert sum(k > 0 for k in large[10:]) / len(large[10:]) <= 0.1
    # The other arm is still tried now and then, so a change is noticed.
    assert sum(k > 0 for k in large[10:]) > 0
    k = c.lookahead(64)
    assert c.enabled == (k > 0)


def test_the_decision_follows_a_change_in_what_pays() -> None:
    c = SpecController(4, explore_every=10)
    drive(c, batch=8, steps=100, on_rate=100.0, off_rate=200.0)
    later = drive(c, batch=8, steps=300, on_rate=400.0, off_rate=200.0)
    assert sum(k > 0 for k in later[-100:]) >= 85


def test_batch_sizes_are_judged_separately() -> None:
    assert [bucket_of(n) for n in (0, 1, 2, 3, 4, 7, 8, 64)] == [1, 1, 2, 2, 3, 3, 4, 7]
    c = SpecController(3)
    drive(c, batch=2, steps=50, on_rate=10.0, off_rate=100.0)
    assert c.lookahead(40) == 3  # a bucket it has not measured starts by trying speculation


def test_not_adaptive_always_speculates() -> None:
    c = SpecController(5, adaptive=False)
    assert set(drive(c, batch=64, steps=50, on_rate=1.0, off_rate=1000.0)) == {5}


def test_a_request_with_poor_acceptance_gets_one_proposal() -> None:
    c = SpecController(4)
    assert c.request_lookahead(4, None, 0) == 4
    assert c.request_lookahead(4, 0.1, 4) == 4  # too few proposals to judge
    assert c.request_lookahead(4, 0.1, 20) == 1
    assert c.request_lookahead(4, 0.6, 20) == 4
    assert c.request_lookahead(0, 0.6, 20) == 0
    rate = None
    for accepted in (0, 0, 0, 1):
        rate = updated_acceptance(rate, 4, accepted)
    assert rate is not None and rate < 0.1
    assert updated_acceptance(0.5, 0, 0) == 0.5
