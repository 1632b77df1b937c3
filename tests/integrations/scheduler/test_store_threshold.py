"""vLLM's ``store_threshold`` as kvoffload's vLLM managers count it (one counter for both)."""

from __future__ import annotations

from kvoffload.integrations.vllm.scheduler.store_threshold import StoreThreshold


def test_a_key_is_worth_storing_on_its_threshold_offer() -> None:
    t = StoreThreshold(3, max_tracker_size=8)
    assert t.active
    assert [t.offered(b"a") for _ in range(4)] == [False, False, True, True]


def test_below_two_every_offer_counts_and_the_counter_is_inactive() -> None:
    for threshold in (0, 1):
        t = StoreThreshold(threshold)
        assert not t.active and t.offered(b"a")


def test_the_tracker_forgets_the_least_recently_offered_key() -> None:
    t = StoreThreshold(2, max_tracker_size=2)
    assert not t.offered(b"a") and not t.offered(b"b")
    assert not t.offered(b"c")  # pushes "a" out
    assert not t.offered(b"a")  # counted from zero again ("b" goes)
    assert t.offered(b"c")  # "c" kept its count
    t.clear()
    assert not t.offered(b"c")
