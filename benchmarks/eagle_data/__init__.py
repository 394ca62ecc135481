"""Training and evaluation data for EAGLE heads (``scripts/train_eagle.py``,
``benchmarks.spec``): prompts from several sources, the target's own greedy responses, and the
target's features computed by this runtime exactly as serving computes them
(``ModelRunner.forward(..., features=True)``: same dtype, final norm, kernels). No data set is
downloaded or copied.

* :mod:`.templates`: the template generator (instructions over topics, code tasks, arithmetic,
  two-turn chats) and its held-out split;
* :mod:`.magpie`: user turns the target writes itself;
* :mod:`.package_text`: requests around text shipped in networkx and sympy (BSD-3-Clause);
* :mod:`.mix`: the training set made of them (+ follow-up turns) and the evaluation sets' items;
* :mod:`.evalsets`: the three sets a head is measured on, and the filter that keeps training
  prompts out of them;
* :mod:`.generate`: responses and features in one continuously batched pass;
* :mod:`.store`: shards and files that let an interrupted run resume.
"""

from __future__ import annotations

from . import evalsets
from .generate import responses_and_features
from .mix import Mix, eval_items, training_items
from .store import Item, Shards, load, log, save
from .templates import CODE_TASKS, TOPICS, prompts


def encode(tokenizer, conversations: list[list[dict]]) -> list[list[int]]:
    return [tokenizer.encode_chat(c) for c in conversations]


__all__ = [
    "CODE_TASKS",
    "TOPICS",
    "Item",
    "Mix",
    "Shards",
    "encode",
    "eval_items",
    "evalsets",
    "load",
    "log",
    "prompts",
    "responses_and_features",
    "save",
    "training_items",
]
