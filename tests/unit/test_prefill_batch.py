"""Which ready rooms make the prefill stage's next batch, and how a long prompt is chunked."""

from __future__ import annotations

from collections import deque

from backends.stages.prefill.batch import chunks, take


def test_take_fills_the_budget_in_order_and_skips_rooms_no_longer_ready():
    tokens = {1: 100, 2: None, 3: 200, 4: 50, 5: 10}
    ready = deque([1, 2, 3, 4, 5])
    assert take(ready, tokens.get, 350) == [1, 3, 4]  # 2 left the queue; 5 would fit, 4 ended it
    assert list(ready) == [5]
    ready = deque([1, 3, 4])
    assert take(ready, tokens.get, 250) == [1]  # in order: 3 does not fit, nothing jumps it
    assert take(ready, tokens.get, 250) == [3, 4]


def test_a_prompt_over_the_budget_goes_alone_and_is_chunked():
    ready = deque([7, 8])
    assert take(ready, {7: 5000, 8: 10}.get, 4096) == [7]
    assert chunks(5000, 4096) == [(0, 4096), (4096, 5000)]
    assert chunks(16, 16) == [(0, 16)] and chunks(17, 16) == [(0, 16), (16, 17)]
