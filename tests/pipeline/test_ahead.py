"""ordered_ahead works ahead of its caller in threads and hands the results back in order."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.ahead import ordered_ahead


@settings(max_examples=30, deadline=None)
@given(
    delays=st.lists(st.integers(0, 3), max_size=12),
    workers=st.integers(1, 4),
)
def test_results_come_in_order_with_at_most_workers_plus_one_alive(delays, workers):
    alive, peak, lock = 0, 0, threading.Lock()

    def work(index: int) -> int:
        nonlocal alive, peak
        with lock:
            alive += 1
            peak = max(peak, alive)
        time.sleep(delays[index] / 1000)
        return index * 10

    got = []
    for result in ordered_ahead(work, range(len(delays)), workers):
        got.append(result)
        # The caller is done with this result: it no longer counts.
        with lock:
            alive -= 1
    assert got == [10 * i for i in range(len(delays))]
    assert peak <= workers + 1


def test_a_failure_reaches_the_caller_at_its_item():
    def work(index: int) -> int:
        if index == 2:
            raise ValueError(f"item {index} is bad")
        return index

    results = ordered_ahead(work, range(5), 2)
    assert [next(results), next(results)] == [0, 1]
    with pytest.raises(ValueError, match="item 2 is bad"):
        next(results)
