"""The template generator: instructions over topics, code tasks, arithmetic, and two-turn chats,
each prompt distinct. The held-out split shares no topic and no code task with training:
evaluation prompts use the last fifth of each list (``held_out=True``)."""

from __future__ import annotations

import json
import random

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
