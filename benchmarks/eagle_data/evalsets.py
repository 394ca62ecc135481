"""The three prompt sets an EAGLE head is measured on (``benchmarks.spec --sets``, and
``scripts/train_eagle.py``'s teacher-forced evaluation), and the checks that keep training
prompts out of them:

* ``chat``: :data:`CHAT_PROMPTS`, eight plain chat prompts (the benchmark's since it exists);
* ``held-out``: the template generator's held-out split (topics and code tasks training never
  sees);
* ``independent``: ``tests/data/independent_prompts.json``, written by hand, not by any
  generator here.

A training prompt that repeats one of them (:class:`Overlap`) or names a held-out topic or code
task (:func:`names_held_out`) is dropped where training prompts are made.
"""

from __future__ import annotations

import json
import os
import re

from . import templates

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INDEPENDENT = os.path.join(ROOT, "tests", "data", "independent_prompts.json")
SETS = ("chat", "held-out", "independent")
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "List three uses of a paperclip.",
    "What is 12 times 7?",
    "Give me a tip for learning a new language.",
    "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?",
]


def independent() -> list[list[dict]]:
    """The hand-written set as conversations (a bare string is one user turn)."""
    with open(INDEPENDENT) as f:
        items = json.load(f)["prompts"]
    return [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in items]


def conversations(name: str, n: int = 0, seed: int = 1) -> list[list[dict]]:
    """A set's conversations: ``n`` of them (0: all; ``held-out``: ``n`` of its split drawn
    from ``seed``, 48 by default)."""
    if name == "chat":
        convs = [[{"role": "user", "content": t}] for t in CHAT_PROMPTS]
    elif name == "independent":
        convs = independent()
    elif name == "held-out":
        return templates.prompts(n or 48, seed, held_out=True)
    else:
        raise ValueError(f"unknown prompt set {name!r}: one of {SETS}")
    return convs[:n] if n else convs


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


STOP = set(
    "a an the of to in on for and or but is are was were be been do does did can could would"
    " should will i me my you your it its this that these those what how why who when where"
    " which with about as at by from into than then so some any me please tell give write"
    " make explain describe list".split()
)


class Overlap:
    """Whether a text repeats one of ``texts``: it shares with one a run of ``n`` words of which
    2 are content words (stop words and request verbs aside), or, where either has at most 6
    content words, 3/5 of the shorter one's content words and at least 2 ("Why is the sky so
    blue?" repeats "Why is the sky blue?"; "What is the capital of Spain?" does not repeat
    "What is the capital of France?")."""

    def __init__(self, texts: list[str], n: int = 6):
        self.n = n
        self.content = [set(words(t)) - STOP for t in texts]
        self.runs = {r for t in texts for r in self._runs(words(t))}

    def _runs(self, w: list[str]):
        for i in range(len(w) - self.n + 1):
            run = tuple(w[i : i + self.n])
            if len(set(run) - STOP) >= 2:
                yield run

    def __call__(self, text: str) -> bool:
        w = words(text)
        if any(r in self.runs for r in self._runs(w)):
            return True
        mine = set(w) - STOP
        for other in self.content:
            small = min(len(mine), len(other))
            if small <= 6 and len(mine & other) >= max(2, 0.6 * small):
                return True
        return False


def eval_overlap() -> Overlap:
    """The :class:`Overlap` of every user turn of the chat and independent sets."""
    texts = [m["content"] for name in ("chat", "independent") for c in conversations(name)
             for m in c if m["role"] == "user"]  # fmt: skip
    return Overlap(texts)


_HELD_NAMES = [x for names in (templates.TOPICS, templates.CODE_TASKS)
               for x in names[len(names) * 4 // 5 :]]  # fmt: skip
_HELD = re.compile(r"\b(" + "|".join(map(re.escape, _HELD_NAMES)) + r")\b", re.IGNORECASE)


def names_held_out(text: str) -> bool:
    """Whether ``text`` names a topic or code task of the held-out split."""
    return _HELD.search(text) is not None
