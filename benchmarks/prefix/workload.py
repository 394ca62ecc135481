"""The multi-turn chat workload: a shared system prompt, chats of growing history run at once,
and how much of each prompt an earlier request already carried (the reuse a cache can get)."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from benchmarks.common import log

TOPICS = [
    "opening hours", "late returns", "lost cards", "printing", "study rooms", "e-books",
    "children's events", "interlibrary loans", "donations", "accessibility", "wifi", "parking",
    "local history", "language courses", "job search help", "3D printers", "film nights",
    "quiet zones", "group visits", "volunteering", "rare books", "museum passes", "tax forms",
]  # fmt: skip
STYLES = [
    "answer in two or three short sentences and offer one concrete next step",
    "be warm and precise, and never invent a policy that is not written here",
    "mention the relevant desk or web page, and ask whether anything else is needed",
    "explain the rule first and the reason for it second, in plain words",
    "give the answer as a short list when there are several options",
]  # fmt: skip
FIRST = [
    "Hi! Can you tell me about {t}?", "I have a question about {t}. How does it work here?",
    "What should I know about {t} before I come in?", "Explain your rules on {t}, please.",
]  # fmt: skip
FOLLOW = [
    "Thanks. Can you say a bit more about that?", "Could you give me an example?",
    "And what about {t}?", "How does that compare with {t}?", "Please summarize that in one line.",
    "Is there a fee for {t}?", "Who do I ask about {t} if I have a problem?",
]  # fmt: skip


def system_prompt(tok, tokens: int, seed: int) -> str:
    """A library assistant's instructions, numbered rules over TOPICS, cut at ``tokens``."""
    rng = random.Random(seed)
    text = (
        "You are Atlas, the assistant of the Riverside Public Library. Follow these rules in"
        " every conversation."
    )
    rule = 1
    while len(tok.encode_text(text, special=False)) < tokens:
        t, style = rng.choice(TOPICS), rng.choice(STYLES)
        text += f"\n{rule}. When a visitor asks about {t}, {style}."
        rule += 1
    return tok.decode(tok.encode_text(text, special=False)[:tokens])


@dataclass
class Chat:
    index: int
    users: list[str]  # the user's turns
    answers: list[str] = field(default_factory=list)  # the model's, as they come


def chats(n: int, turns: tuple[int, int], seed: int) -> list[Chat]:
    """``n`` chats of ``turns`` (low, high) user turns each, drawn."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.randint(*turns)
        users = [rng.choice(FIRST).format(t=rng.choice(TOPICS))]
        users += [rng.choice(FOLLOW).format(t=rng.choice(TOPICS)) for _ in range(k - 1)]
        out.append(Chat(i, users))
    return out


def messages(system: str, chat: Chat, turn: int) -> list[dict]:
    """Turn ``turn``'s chat: the system prompt, every earlier turn and its answer, the new one."""
    msgs = [{"role": "system", "content": system}]
    for u, a in zip(chat.users[:turn], chat.answers[:turn], strict=True):
        msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    return msgs + [{"role": "user", "content": chat.users[turn]}]


@dataclass
class Reply:
    """One streamed request as the client saw it (times: ``time.monotonic()``)."""

    sent: float
    first: float | None = None  # the first streamed token
    ids: list[int] = field(default_factory=list)
    cached: int = 0  # usage: prompt tokens served from the prefix cache
    error: str | None = None


def run_chats(backend, tok, system: str, convs: list[Chat], max_tokens: int, stagger: float):
    """Every chat on its own thread (chat i starts ``i * stagger`` s in), each turn sent when the
    previous answer ended; ``backend.ask(ids, max_tokens) -> Reply``. Records in send order:
    {chat, turn, prompt (ids), reply}."""
    records, lock = [], threading.Lock()

    def one(chat: Chat) -> None:
        time.sleep(chat.index * stagger)
        for turn in range(len(chat.users)):
            ids = tok.encode_chat(messages(system, chat, turn))
            rec = {"chat": chat.index, "turn": turn, "prompt": ids, "reply": Reply(0.0)}
            with lock:
                records.append(rec)
            rec["reply"] = reply = backend.ask(ids, max_tokens)
            if reply.error:
                log(f"chat {chat.index} turn {turn}: {reply.error}")
                return  # the chat cannot go on without its answer
            chat.answers.append(tok.decode(reply.ids))

    threads = [threading.Thread(target=one, args=(c,), daemon=True) for c in convs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records


def reuse(records: list[dict]) -> list[int]:
    """Per record (send order): the longest prefix of its prompt that an earlier record's prompt
    + answer carried (the tokens some cache could hold when it was sent)."""
    seen: list[np.ndarray] = []
    out = []
    for rec in records:
        p = np.asarray(rec["prompt"])
        best = 0
        for s in seen:
            m = min(len(s), len(p))
            diff = np.flatnonzero(s[:m] != p[:m])
            best = max(best, int(diff[0]) if diff.size else m)
        out.append(best)
        seen.append(np.asarray(rec["prompt"] + rec["reply"].ids))
    return out
