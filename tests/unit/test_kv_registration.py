"""Prefill's checks of a Register's page lists (kvtransfer/sender/registration.py), per entry
kind: the blocks from the entry's ``first`` on (every block, or after decode's cached prefix),
only the blocks the last window reaches of a window entry, one slot of a state entry; anything
else is refused naming the entry."""

import re

import pytest
from test_kv_layout import gqa, state

from kvtransfer import messages as m
from kvtransfer.sender.registration import RegistrationError, check_entries

LAYOUTS = {
    "target": gqa(),  # page 4, 10 pages
    "target.window": gqa(role="target.window", window=8),
    "target.state": state(),
}
# 13 tokens: 4 blocks; the window (tokens 5..12) reaches blocks 1..3; one state slot
ENTRIES = {"target": [0, 1, 2, 3], "target.window": [7, 8, 9], "target.state": [5]}
FIRST = {"target.window": 1}


def register(num_tokens: int, entries: dict[str, list[int]], first: dict[str, int]) -> m.Register:
    specs = [
        m.EntrySpec(role, lay.signature(), pages, 1 << 30, lay.num_pages, first.get(role, 0))
        for role, pages in entries.items()
        if (lay := LAYOUTS[role])
    ]
    return m.Register(7, "127.0.0.1:1", specs, num_tokens, 1, b"p" * 16)


def test_each_entry_kind_registers_the_pages_its_kind_holds():
    dst = check_entries(register(13, ENTRIES, FIRST), LAYOUTS, 13)
    assert set(dst) == set(LAYOUTS) and dst["target.state"].segments == ((1, 12), (1, 8))


@pytest.mark.parametrize("cached, pages", [(2, [2, 3]), (4, [])])  # a hit; a full hit
def test_decode_registers_only_the_blocks_after_its_cached_prefix(cached, pages):
    # 16 tokens: the window (tokens 8..15) reaches blocks 2, 3
    entries = {**ENTRIES, "target": pages, "target.window": [8, 9]}
    check_entries(register(16, entries, {"target.window": 2, "target": cached}), LAYOUTS, 16)


@pytest.mark.parametrize(
    "role, pages, first, why",
    [
        ("target.window", [6, 7, 8, 9], 1, "4 pages from block 1 for 13 tokens (need 3)"),
        ("target.window", [6, 7, 8, 9], 0, "first block 0 outside [1, 3]"),  # before the window
        ("target", [], 4, "first block 4 outside [0, 3]"),  # 13 tokens: block 3 is partial
        ("target", [1, 2, 3], 2, "3 pages from block 2 for 13 tokens (need 2)"),
        ("target.state", [1, 2], 0, "2 pages from block 0 for 13 tokens (need 1)"),
        ("target.state", [], 1, "first block 1 outside [0, 0]"),  # a state is never cached
        ("target.state", [6], 0, "outside [0, 6)"),
    ],
)
def test_a_register_with_other_pages_is_refused(role, pages, first, why):
    entries, firsts = {**ENTRIES, role: pages}, {**FIRST, role: first}
    with pytest.raises(RegistrationError, match=re.escape(why)):
        check_entries(register(13, entries, firsts), LAYOUTS, 13)
