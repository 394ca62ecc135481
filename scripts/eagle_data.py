"""Training data for EAGLE heads (``scripts/train_eagle.py``): the project's own prompts and the
target's own responses, with the target's features computed by this runtime exactly as serving
computes them (``ModelRunner.forward(..., features=True)``: same dtype, final norm, kernels).

Prompts are generated from templates: instructions over topics, code tasks, arithmetic, and
two-turn chats. No dataset is read or copied. The held-out split is by topic: evaluation
prompts are about topics no training prompt mentions.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

import torch

TOPICS = [
    "the moon", "tax law", "sourdough bread", "graph theory", "jazz", "volcanoes",
    "the printing press", "honeybees", "compilers", "marathon training", "glaciers", "chess",
    "photosynthesis", "the Roman empire", "electric cars", "coral reefs", "prime numbers",
    "coffee", "black holes", "the water cycle", "vaccines", "origami", "solar panels",
    "the French revolution", "sleep", "recycling", "earthquakes", "penguins", "bridges",
    "the internet", "tea ceremonies", "rainforests", "magnets", "democracy", "bicycles",
    "the human heart", "chocolate", "submarines", "tides", "wind turbines", "dinosaurs",
    "libraries", "batteries", "mountains", "the violin", "deserts", "rockets", "bread mold",
    "friendship", "budgeting", "public speaking", "gardening", "the stock market", "whales",
]  # fmt: skip
INSTRUCTIONS = [
    "Explain {t} to a child.", "Write three facts about {t}.", "What is surprising about {t}?",
    "Give a short history of {t}.", "Write a haiku about {t}.", "Why does {t} matter?",
    "Summarize what an expert knows about {t} in a paragraph.", "List pros and cons of {t}.",
    "Write a short story that involves {t}.", "What questions do people ask about {t}?",
]  # fmt: skip
CODE = [
    "Write a Python function that {c}.", "Explain how to {c} in JavaScript.",
    "Write a unit test for a function that {c}.",
]  # fmt: skip
CODE_TASKS = [
    "reverses a string", "checks if a number is prime", "sorts a list of names",
    "counts words in a text", "merges two dictionaries", "finds the largest element",
    "computes a factorial", "parses a date", "removes duplicates from a list",
    "reads a CSV file", "computes the average of a list", "validates an email address",
]  # fmt: skip


def prompts(n: int, seed: int, held_out: bool) -> list[list[dict]]:
    """``n`` chat conversations (lists of messages); ``held_out``: topics of the last fifth."""
    rng = random.Random(seed)
    cut = len(TOPICS) * 4 // 5
    topics = TOPICS[cut:] if held_out else TOPICS[:cut]
    out = []
    for i in range(n):
        kind = i % 5
        t = rng.choice(topics)
        if kind == 0:
            text = rng.choice(CODE).format(c=rng.choice(CODE_TASKS))
        elif kind == 1:
            a, b = rng.randint(2, 999), rng.randint(2, 99)
            text = f"What is {a} times {b}? Show your steps, then mention {t}."
        else:
            text = rng.choice(INSTRUCTIONS).format(t=t)
        msgs = [{"role": "user", "content": text}]
        if kind == 4:  # a two-turn chat
            msgs += [{"role": "assistant", "content": f"Sure, let us talk about {t}."},
                     {"role": "user", "content": rng.choice(INSTRUCTIONS).format(t=t)}]  # fmt: skip
        out.append(msgs)
    return out


def encode(tokenizer, conversations: list[list[dict]]) -> list[list[int]]:
    return [tokenizer.encode_chat(c) for c in conversations]


def log(msg: str) -> None:
    print(f"[train_eagle] {msg}", file=sys.stderr, flush=True)


def responses(runner, prompt_ids: list[list[int]], max_tokens: int, batch: int = 16):
    """The target's greedy responses (its own text is what the head will see served)."""
    from backends.runtime.engine import LLMEngine
    from backends.runtime.sampler import SamplingParams

    longest = max(len(p) for p in prompt_ids) + max_tokens
    pool = runner.make_pool(batch * -(-longest // 16) + 1, 16)
    engine = LLMEngine(runner, pool, max_batch=batch)
    out, t0 = [], time.time()
    for i in range(0, len(prompt_ids), batch):
        chunk = prompt_ids[i : i + batch]
        seqs = engine.generate([(p, SamplingParams(max_tokens=max_tokens)) for p in chunk])
        out += [s.output_ids for s in seqs]
        done = len(out)
        log(f"responses {done}/{len(prompt_ids)} ({time.time() - t0:.0f} s)")
    return out


def features(runner, sequences: list[list[int]]) -> list[torch.Tensor]:
    """The target's final-norm features of every position of each sequence [T, H] (float32)."""
    from backends.runtime.runner import SeqInput

    feats = []
    for seq in sequences:
        pool = runner.make_pool(-(-len(seq) // 16), 16)
        _, (f,) = runner.forward(pool, [SeqInput(seq, 0, list(range(pool.num_pages)))],
                                 last_only=True, features=True)  # fmt: skip
        feats.append(f.float().clone())
    return feats


def save(path: str, key: dict, items: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Keep (tokens, features) pairs in a safetensors file tagged with ``key``."""
    from safetensors.torch import save_file

    tensors = {f"{i}.{n}": t.contiguous() for i, pair in enumerate(items)
               for n, t in zip(("tokens", "feats"), pair, strict=True)}  # fmt: skip
    save_file(tensors, path, metadata={"key": json.dumps(key, sort_keys=True)})


def load(path: str, key: dict) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The pairs :func:`save` kept at ``path`` under the same ``key``, else None."""
    from safetensors import safe_open

    if not os.path.exists(path):
        return None
    with safe_open(path, "pt") as f:
        if f.metadata().get("key") != json.dumps(key, sort_keys=True):
            return None
        n = len(list(f.keys())) // 2
        return [(f.get_tensor(f"{i}.tokens"), f.get_tensor(f"{i}.feats")) for i in range(n)]
