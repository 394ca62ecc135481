"""Prefill's checks of a Register's page lists (kvtransfer/sender/registration.py), per entry
kind: every block of a full entry, only the blocks the last window reaches of a window entry,
one slot of a state entry; anything else is refused naming the entry."""

import re

import pytest
from test_kv_layout import gqa, state

from kvtransfer import messages as m
from kvtransfer.sender.registration import RegistrationError, check_entries


def register(num_tokens: int, entries: dict[str, list[int]], layouts: dict) -> m.Register:
    specs = [
        m.EntrySpec(role, layouts[role].signature(), pages, 1 << 30, layouts[role].num_pages)
        for role, pages in entries.items()
    ]
    return m.Register(7, "127.0.0.1:1", specs, num_tokens, 1, b"p" * 16)


LAYOUTS = {
    "target": gqa(),  # page 4, 10 pages
    "target.window": gqa(role="target.window", window=8),
    "target.state": state(),
}


def test_each_entry_kind_registers_the_pages_its_kind_holds():
    # 13 tokens: 4 blocks; the window (tokens 5..12) reaches blocks 1..3; one state slot
    entries = {"target": [0, 1, 2, 3], "target.window": [7, 8, 9], "target.state": [5]}
    reg = register(13, entries, LAYOUTS)
    dst = check_entries(reg, LAYOUTS, 13)
    assert set(dst) == set(LAYOUTS) and dst["target.state"].segments == ((2, 12), (2, 8))


@pytest.mark.parametrize(
    "role, pages, why",
    [
        ("target.window", [6, 7, 8, 9], "4 pages for 13 tokens (need 3)"),  # every block
        ("target.state", [1, 2], "2 pages for 13 tokens (need 1)"),
        ("target.state", [6], "outside [0, 6)"),
    ],
)
def test_a_register_with_another_page_count_is_refused(role, pages, why):
    entries = {"target": [0, 1, 2, 3], "target.window": [7, 8, 9], "target.state": [5]}
    entries[role] = pages
    with pytest.raises(RegistrationError, match=re.escape(why)):
        check_entries(register(13, entries, LAYOUTS), LAYOUTS, 13)
