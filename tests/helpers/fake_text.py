"""A byte-level fake tokenizer for the 256-token tiny test models: every id is a few bytes, some
ids are halves of a two-byte UTF-8 character, ids 0-2 (pad, bos, eos) are special."""

from __future__ import annotations

SPECIAL = (0, 1, 2)
_WORDS = ["the", " cat", " sat", "on", " a", " mat", ".", "\n", "ab", "c", " ", "!", "xy", "z"]


def piece(t: int) -> bytes:
    if t in SPECIAL:
        return b"<s>"
    if t < 200:
        return _WORDS[t % len(_WORDS)].encode() + (b"" if t < 100 else bytes([97 + t % 26]))
    if t < 228:  # even: a UTF-8 lead byte, odd: a continuation byte (e.g. 0xC3 0xA9 = "é")
        return b"\xc3" if t % 2 == 0 else bytes([0x80 + (t - 200)])
    return "é€"[t % 2].encode()


class ByteTokenizer:
    def __init__(self) -> None:
        self.calls = 0  # decode calls (the incremental decoder must stay windowed)
        self.decoded = 0  # ids decoded in all

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.calls += 1
        self.decoded += len(ids)
        keep = [t for t in ids if not (skip_special_tokens and t in SPECIAL)]
        return b"".join(piece(t) for t in keep).decode("utf-8", errors="replace")
