"""Training data for EAGLE heads (``scripts/train_eagle.py``): the project's own prompts and the
target's own responses, with the target's features computed by this runtime exactly as serving
computes them (``ModelRunner.forward(..., features=True)``: same dtype, final norm, kernels).

Prompts are generated from templates, each one distinct: instructions over topics, code tasks,
arithmetic, and two-turn chats. No dataset is read or copied. The held-out split shares no topic
and no code task with training: evaluation prompts use the last fifth of each list (the
held-out split ``python -m benchmarks.spec --held-out N`` measures acceptance on).
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
    "airplanes", "the immune system", "climate change", "ancient Egypt", "pizza", "robots",
    "owls", "the ocean floor", "music theory", "money", "trains", "clouds", "the brain",
    "cats", "dogs", "poetry", "olive oil", "hurricanes", "video games", "paper making",
    "the alphabet", "museums", "lighthouses", "bees and flowers", "soap", "maps", "kites",
    "the Olympic games", "mushrooms", "telescopes", "rivers", "volunteering", "castles",
    "elections", "spiders", "the piano", "cheese", "snow", "salt", "trees", "ants",
    "the speed of light", "fire", "glass", "cotton", "the calendar", "islands", "sharks",
    "eclipses", "bread baking", "board games", "fungi", "the Great Wall", "sailing",
    "newspapers", "fossils", "rain", "dance", "insurance", "caves", "bees' honey",
    "the Silk Road", "statistics", "archery", "wolves", "tomatoes", "clocks", "mirrors",
    "the post office", "farming", "rice", "painting", "cameras", "the Arctic", "elephants",
    "umbrellas", "language learning", "nutrition", "skateboarding", "the desert sun",
    "mathematics", "philosophy", "sculpture", "the economy", "cooking pasta", "astronauts",
]  # fmt: skip
INSTRUCTIONS = [
    "Explain {t} to a child.", "Write three facts about {t}.", "What is surprising about {t}?",
    "Give a short history of {t}.", "Write a haiku about {t}.", "Why does {t} matter?",
    "Summarize what an expert knows about {t} in a paragraph.", "List pros and cons of {t}.",
    "Write a short story that involves {t}.", "What questions do people ask about {t}?",
    "Describe {t} in five sentences.", "Write a limerick about {t}.",
    "What are common myths about {t}?", "How would you teach a class about {t}?",
    "Compare {t} with something from everyday life.", "Write a tweet about {t}.",
    "What would the world be like without {t}?", "Give me a fun quiz about {t}.",
    "Write an email to a friend about {t}.", "What careers involve {t}?",
    "Explain {t} in one paragraph for a busy adult.", "Write a dialogue about {t}.",
    "What are the main ideas behind {t}?", "Write a news headline and lead about {t}.",
]  # fmt: skip
CODE = [
    "Write a Python function that {c}.", "Explain how to {c} in JavaScript.",
    "Write a unit test for a function that {c}.", "Write a C function that {c}.",
    "Write a Python function that {c}, for an app about {t}.",
    "Explain, with an example about {t}, how to write code that {c}.",
]  # fmt: skip
CODE_TASKS = [
    "reverses a string", "checks if a number is prime", "sorts a list of names",
    "counts words in a text", "merges two dictionaries", "finds the largest element",
    "computes a factorial", "parses a date", "removes duplicates from a list",
    "reads a CSV file", "computes the average of a list", "validates an email address",
    "checks for a palindrome", "flattens a nested list", "counts vowels in a word",
    "converts Celsius to Fahrenheit", "finds the median of a list", "capitalizes each word",
    "computes Fibonacci numbers", "checks if two words are anagrams", "sums the digits of a number",
    "finds common elements of two lists", "converts a number to binary", "rotates a list",
    "groups words by their first letter", "computes the greatest common divisor",
    "counts the lines in a file", "shuffles a deck of cards", "finds the second smallest number",
    "transposes a matrix",
]  # fmt: skip
OPS = ["plus", "minus", "times"]
PAGE = 16  # the KV page size of the target's pools here


def _prompt(rng: random.Random, kind: int, topics: list[str], tasks: list[str]) -> list[dict]:
    t = rng.choice(topics)
    if kind == 0:
        text = rng.choice(CODE).format(c=rng.choice(tasks), t=t)
    elif kind == 1:
        a, b = rng.randint(2, 999), rng.randint(2, 99)
        text = f"What is {a} {rng.choice(OPS)} {b}? Show your steps, then mention {t}."
    else:
        text = rng.choice(INSTRUCTIONS).format(t=t)
    msgs = [{"role": "user", "content": text}]
    if kind == 4:  # a two-turn chat
        msgs += [{"role": "assistant", "content": f"Sure, let us talk about {t}."},
                 {"role": "user", "content": rng.choice(INSTRUCTIONS).format(t=t)}]  # fmt: skip
    return msgs


def prompts(n: int, seed: int, held_out: bool) -> list[list[dict]]:
    """``n`` chat conversations (lists of messages) of five kinds in turn, each distinct while
    its kind has unused ones; ``held_out``: the last fifth of the topics and code tasks, which
    training never sees."""
    rng = random.Random(seed)
    topics, tasks = (xs[len(xs) * 4 // 5 :] if held_out else xs[: len(xs) * 4 // 5]
                     for xs in (TOPICS, CODE_TASKS))  # fmt: skip
    out, seen = [], set()
    for i in range(n):
        for _ in range(20):
            msgs = _prompt(rng, i % 5, topics, tasks)
            if (text := json.dumps(msgs)) not in seen:
                break
        seen.add(text)
        out.append(msgs)
    return out


def encode(tokenizer, conversations: list[list[dict]]) -> list[list[int]]:
    return [tokenizer.encode_chat(c) for c in conversations]


def log(msg: str) -> None:
    print(f"[train_eagle] {msg}", file=sys.stderr, flush=True)


def responses(runner, prompt_ids: list[list[int]], max_tokens: int, batch: int = 256):
    """The target's greedy responses (its own text is what the head will see served), all
    prompts in one continuously batched run of up to ``batch`` sequences (a batch refilled as
    sequences end: 1.4x the tokens/s of batches of 48 run to their end, on 2 cores)."""
    from backends.runtime.engine import LLMEngine
    from backends.runtime.sampler import SamplingParams

    longest = max(len(p) for p in prompt_ids) + max_tokens
    pool = runner.make_pool(batch * -(-longest // PAGE) + 1, PAGE)
    engine = LLMEngine(runner, pool, max_batch=batch)
    sp = SamplingParams(max_tokens=max_tokens)
    seqs = [engine.add_request(f"data-{i}", p, sp) for i, p in enumerate(prompt_ids)]
    t0 = shown = time.time()
    while engine.has_unfinished():
        engine.step()
        if time.time() - shown > 30:
            shown, done = time.time(), sum(s.finished for s in seqs)
            log(f"responses {done}/{len(seqs)} ({shown - t0:.0f} s)")
    log(f"responses {len(seqs)}/{len(seqs)} ({time.time() - t0:.0f} s)")
    return [s.output_ids for s in seqs]


def features(runner, sequences: list[list[int]], batch: int = 16) -> list[torch.Tensor]:
    """The target's final-norm features of every position of each sequence [T, H] (float32),
    ``batch`` sequences per forward."""
    from backends.runtime.paged import SeqInput

    feats, t0 = [], time.time()
    for i in range(0, len(sequences), batch):
        if i % (20 * batch) == 0:
            log(f"features {i}/{len(sequences)} ({time.time() - t0:.0f} s)")
        chunk, seqs, n = sequences[i : i + batch], [], 0
        for seq in chunk:
            pages = -(-len(seq) // PAGE)
            seqs.append(SeqInput(seq, 0, list(range(n, n + pages))))
            n += pages
        _, fs = runner.forward(runner.make_pool(n, PAGE), seqs, last_only=True, features=True)
        feats += [f.float().clone() for f in fs]
    return feats


def save(path: str, key: dict, items: list[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
    """Keep (tokens, features, prompt length) items in a safetensors file tagged with ``key``."""
    from safetensors.torch import save_file

    tensors = {}
    for i, (tokens, feats, plen) in enumerate(items):
        tensors |= {f"{i}.tokens": tokens.contiguous(), f"{i}.feats": feats.contiguous(),
                    f"{i}.plen": torch.tensor([plen])}  # fmt: skip
    save_file(tensors, path, metadata={"key": json.dumps(key, sort_keys=True)})


def load(path: str, key: dict) -> list[tuple[torch.Tensor, torch.Tensor, int]] | None:
    """The items :func:`save` kept at ``path`` under the same ``key``, else None."""
    from safetensors import safe_open

    if not os.path.exists(path):
        return None
    with safe_open(path, "pt") as f:
        if f.metadata().get("key") != json.dumps(key, sort_keys=True):
            return None
        n = len(list(f.keys())) // 3
        return [(f.get_tensor(f"{i}.tokens"), f.get_tensor(f"{i}.feats"),
                 int(f.get_tensor(f"{i}.plen")[0])) for i in range(n)]  # fmt: skip
