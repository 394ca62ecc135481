"""User turns the target writes itself (Magpie-style self-instruct): the chat template up to the
start of a user turn, plus a starter word ("How", "Write a Python function", "Calculate", ...),
sampled at temperature 1 from the 64 likeliest tokens (top-k: a nucleus sorts the whole
vocabulary of every row at every step) until the model ends the turn. The starters steer the
mix of kinds (short questions, instructions, lists, code, math, personal requests); the model
writes the rest, so the prompts read like its own idea of a user, not like a template. A
follow-up turn is written the same way after a whole conversation (:func:`follow_ups`).

Asking the 135M target to *write a request* ("Write a question a user might ask about X") gives
meta-text ("A user might ask: ..."); completing the user turn gives requests.
"""

from __future__ import annotations

import random
import re

from .evalsets import Overlap, names_held_out
from .generate import PAGE, pool_pages

STARTERS = {
    "question": ["What", "How", "Why", "Who", "When", "Where", "Which", "Is it true that",
                 "Can you tell me", "Do you know", "What's the difference between", "How does",
                 "Is there", "What happens if", "Are"],
    "instruction": ["Write", "Explain", "Describe", "Create", "Summarize", "Rewrite",
                    "Translate", "Generate", "Help me", "Tell me", "Suggest", "Compare", "Draft",
                    "Plan", "Give me an example of", "Write a short story", "Write a poem"],
    "list": ["List", "Give me", "Name", "What are some", "Give me a list of",
             "What are the steps to", "Brainstorm"],
    "code": ["Write a Python function", "Write a function", "In Python,", "How do I",
             "Write a program", "Write a JavaScript", "Write a SQL query", "Write a bash",
             "How can I fix", "What is the difference between a list and", "Implement"],
    "math": ["Calculate", "Solve", "What is the sum of", "If a", "Find the", "How many",
             "A store sells", "What is", "Convert", "If I have"],
    "personal": ["I", "I'm", "My", "I need", "I want to", "I have", "Can you help me",
                 "Could you", "Please"],
}  # fmt: skip
FOLLOW_UPS = ["Can you", "Could you", "What about", "Thanks! Now", "Why", "How", "Make it",
              "Now", "And", "Great.", "Please", "What if", "Can you give", "Explain", "Also,",
              "That's helpful. Can", "I don't understand", "Shorter"]  # fmt: skip
SENTINEL = "\x00USER\x00"


def turn_prefix(tok, conversation: list[dict], starter: str) -> list[int]:
    """Token ids of ``conversation`` in the chat template followed by an open user turn that
    begins with ``starter`` (the template's own text up to where a user turn's words go)."""
    text = tok.render_chat(conversation + [{"role": "user", "content": SENTINEL}], False)
    return tok.encode_text(text[: text.index(SENTINEL)] + starter, special=False)


def sample_turns(runner, tok, prefixes: list[tuple[list[int], str]], seed: int,
                 max_tokens: int = 64, batch: int = 128) -> list[str | None]:  # fmt: skip
    """Per (prefix ids, starter) the user turn the target writes (starter + its words), or None
    where it did not end the turn within ``max_tokens``. Sequence ``i`` draws from its own
    seed (``seed`` and ``i``), so a result does not depend on the batch it ran in."""
    from backends.runtime.engine import LLMEngine
    from backends.runtime.sampling_params import SamplingParams

    if not prefixes:
        return []
    pages = pool_pages([p for p, _ in prefixes], max_tokens, batch)
    engine = LLMEngine(runner, runner.make_pool(pages, PAGE), batch)
    seqs = []
    for i, (ids, _) in enumerate(prefixes):
        sp = SamplingParams(temperature=1.0, top_k=64, max_tokens=max_tokens,
                            seed=seed * 1_000_003 + i)  # fmt: skip
        seqs.append(engine.add_request(f"turn-{i}", ids, sp))
    while engine.has_unfinished():
        engine.step()
    eos = set(runner.config.eos_token_ids)
    out = []
    for s, (_, starter) in zip(seqs, prefixes, strict=True):
        ended = bool(s.output_ids) and s.output_ids[-1] in eos
        words = tok.decode(s.output_ids) if ended else None
        out.append(None if words is None else (starter + words).strip())
    return out


class TurnFilter:
    """Keeps a written user turn that is 2-120 words, has no template markup, is new, repeats
    no evaluation prompt and names no held-out topic."""

    def __init__(self, overlap: Overlap):
        self.overlap, self.seen = overlap, set()

    def __call__(self, text: str | None) -> bool:
        if text is None or "<|" in text or not 2 <= len(text.split()) <= 120:
            return False
        key = re.sub(r"\W+", " ", text.lower()).strip()
        if key in self.seen or self.overlap(text) or names_held_out(text):
            return False
        self.seen.add(key)
        return True


def starters(n: int, seed: int) -> list[str]:
    """``n`` starters, the kinds in turn, each kind's words drawn at random."""
    rng, kinds = random.Random(seed), list(STARTERS)
    return [rng.choice(STARTERS[kinds[i % len(kinds)]]) for i in range(n)]


def user_prompts(runner, tok, n: int, seed: int, keep: TurnFilter,
                 batch: int = 128) -> list[list[dict]]:  # fmt: skip
    """``n`` one-turn conversations whose user turn the target wrote (rounds of 1.4 n samples
    until ``keep`` let ``n`` through, at most 6 rounds)."""
    out: list[list[dict]] = []
    for r in range(6):
        want = n - len(out)
        if want <= 0:
            break
        firsts = starters(int(want * 1.4) + 8, seed * 100 + r)
        texts = sample_turns(runner, tok, [(turn_prefix(tok, [], s), s) for s in firsts],
                             seed * 100 + r, batch=batch)  # fmt: skip
        out += [[{"role": "user", "content": t}] for t in texts if keep(t)][:want]
    return out


def follow_ups(runner, tok, conversations: list[list[dict]], seed: int, keep: TurnFilter,
               batch: int = 64) -> list[list[dict] | None]:  # fmt: skip
    """Per conversation (ending with an assistant turn) a follow-up user turn the target wrote,
    the conversation extended by it; None where none passed ``keep``."""
    rng = random.Random(seed)
    firsts = [rng.choice(FOLLOW_UPS) for _ in conversations]
    prefixes = [(turn_prefix(tok, c, s), s) for c, s in zip(conversations, firsts, strict=True)]
    texts = sample_turns(runner, tok, prefixes, seed, batch=batch)
    return [c + [{"role": "user", "content": t}] if keep(t) else None
            for c, t in zip(conversations, texts, strict=True)]  # fmt: skip
