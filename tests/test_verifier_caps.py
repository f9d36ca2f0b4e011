"""verifier.caps.TenantCap: at most ``limit`` entries per tenant per fixed window, and what a
refused request was let in is given back, in the same window only."""

from __future__ import annotations

from verifier.caps import TenantCap


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_tenant_gets_at_most_its_limit_per_window_and_the_rest_is_dropped():
    clock = Clock()
    cap = TenantCap(5, 60.0, "leak_index", clock)
    assert cap.take("a", range(3)) == [0, 1, 2]
    assert cap.take("a", range(10, 14)) == [10, 11]
    assert cap.take("b", range(2)) == [0, 1]  # another tenant's room is its own
    assert (cap.used("a"), cap.used("b"), cap.dropped) == (5, 2, 2)
    clock.now += 60.0  # a new window: the counts restart
    assert cap.take("a", range(6)) == [0, 1, 2, 3, 4] and cap.used("a") == 5


def test_what_a_refused_request_was_let_in_is_given_back_in_its_window_only():
    clock = Clock()
    cap = TenantCap(5, 60.0, "leak_index", clock)
    kept, window = cap.take_in_window("a", range(4))
    assert (kept, cap.used("a")) == ([0, 1, 2, 3], 4)
    cap.give_back("a", len(kept), window)
    assert cap.used("a") == 0
    assert cap.take("a", range(9)) == [0, 1, 2, 3, 4]  # the whole room again
    kept, window = cap.take_in_window("b", range(3))
    clock.now += 61.0
    assert cap.take("b", range(2)) == [0, 1]  # a new window
    cap.give_back("b", len(kept), window)  # counted in the old window: nothing to give back now
    assert cap.used("b") == 2
