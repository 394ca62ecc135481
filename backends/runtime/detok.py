"""Incremental detokenization of one sequence's output, with stop-string matching.

:class:`TextState` turns a growing list of output token ids into text, decoding only a small
window per call: ``ids[prefix:read]`` (tokens already shown, kept as context so merges and
leading spaces decode as in the full text) and ``ids[prefix:]``; the new text is the
difference. A window that ends in U+FFFD (a multi-byte character cut between tokens) shows
nothing until a later token completes it (``take(final=True)`` releases it as it is).

Stop strings: the first (leftmost) match in the text ends it; the text is cut right before the
stop string, which is never shown. While the sequence runs, :meth:`TextState.take` holds back
the longest suffix that could still begin a stop string, so a streamed client never sees part
of a stop string that matches later. Every ``take()`` and a final ``take(final=True)`` together
give the full decode of the tokens, cut at the stop string.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT = "\ufffd"  # what a trailing incomplete UTF-8 sequence decodes to
# a character is at most 4 UTF-8 bytes: a longer run of tokens that still ends incomplete is
# garbage (a broken model), shown as it is rather than re-decoded at a growing cost per token
MAX_PENDING = 16


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


def _delta(before: str, after: str) -> str:
    if after.startswith(before):
        return after[len(before) :]
    common = 0  # decoding is not always prefix-stable (space clean-up): best effort
    for a, b in zip(before, after, strict=False):
        if a != b:
            break
        common += 1
    return after[common:]


class TextState:
    def __init__(self, tokenizer: Decoder, stop: tuple[str, ...] = ()):
        self.tok = tokenizer
        self.stop = tuple(stop)
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self.ids: list[int] = []  # output tokens consumed so far
        self._prefix = 0  # ids[_prefix:_read] is the decoding context of the next window
        self._read = 0  # ids[:_read] are in ``text``
        self.text = ""  # visible text so far (cut at the stop string once stopped)
        self.taken = 0  # chars of ``text`` already returned by take()
        self.stopped = False
        self.stop_str: str | None = None

    @property
    def consumed(self) -> int:
        return len(self.ids)

    def update(self, output_ids: list[int]) -> bool:
        """Consume ``output_ids[self.consumed:]``; True once a stop string matched (sticky)."""
        if self.stopped or len(output_ids) <= len(self.ids):
            return self.stopped
        for token in output_ids[len(self.ids) :]:  # one at a time: stops at token granularity
            self.ids.append(token)
            self._advance(final=False)
            if self.stopped:
                break
        return self.stopped

    def _advance(self, final: bool) -> None:
        before = self.tok.decode(self.ids[self._prefix : self._read], skip_special_tokens=True)
        after = self.tok.decode(self.ids[self._prefix :], skip_special_tokens=True)
        pending = len(self.ids) - self._read
        if after.endswith(REPLACEMENT) and not final and pending < MAX_PENDING:
            return  # incomplete character: wait for the token that completes it
        new = _delta(before, after)
        self._prefix, self._read = self._read, len(self.ids)
        if new:
            self._append(new)

    def _append(self, new: str) -> None:
        old = len(self.text)
        self.text += new
        if not self.stop:
            return
        start = max(0, old - self._max_stop + 1)  # a match must end inside ``new``
        best = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self.stopped, self.stop_str = True, best[1]
            self.text = self.text[: best[0]]

    def _holdback(self) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        text, best = self.text, 0
        if not text:
            return 0
        last = text[-1]
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if s[n - 1] == last and text.endswith(s[:n]):
                    best = n
                    break
        return best

    def take(self, final: bool = False) -> str:
        """The text not yet taken that is safe to show (everything when ``final``)."""
        if final and not self.stopped and self._read < len(self.ids):
            self._advance(final=True)  # an incomplete trailing character, as the full decode
        end = len(self.text)
        if not (final or self.stopped):
            end = max(self.taken, end - self._holdback())
        out = self.text[self.taken : end]
        self.taken = end
        return out
