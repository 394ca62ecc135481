"""The training set: conversations from four sources, and the target's greedy responses to them
with its features (self-distillation: the text the head learns is the target's own).

* **magpie** (:mod:`.magpie`): user turns the target writes from starter words: short
  questions, instructions, lists, code, math, personal requests;
* **templates** (:mod:`.templates`): the template generator's training split;
* **package** (:mod:`.package_text`): requests around networkx's and sympy's docstrings,
  doctests and functions (both BSD-3-Clause, shipped with torch's dependencies);
* **multi-turn**: one-turn conversations of the above, their response, and a follow-up user
  turn the target writes after them (:func:`.magpie.follow_ups`).

Every written or quoted prompt passes :class:`.magpie.TurnFilter` (no repeat of an
evaluation prompt, no held-out topic). Each stage keeps its result in ``work`` (prompts as JSON,
responses and features as shards, :mod:`.store`), so an interrupted run resumes there.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

from . import evalsets, magpie, package_text, templates
from .generate import responses_and_features
from .store import Item, Shards, load_json, log, save_json

VERSION = 2  # of the prompt sources: a change here invalidates what ``work`` keeps


@dataclass(frozen=True)
class Mix:
    """``prompts`` conversations in all, these shares of them from each source."""

    prompts: int
    magpie: float = 0.45
    templates: float = 0.25
    package: float = 0.15
    multi_turn: float = 0.15

    def counts(self) -> dict[str, int]:
        shares = {"magpie": self.magpie, "templates": self.templates, "package": self.package,
                  "multi_turn": self.multi_turn}  # fmt: skip
        total = sum(shares.values())
        out = {k: int(self.prompts * v / total) for k, v in shares.items()}
        out["magpie"] += self.prompts - sum(out.values())
        return out


def _cached(work: str | None, name: str, key: dict, make):
    path = work and os.path.join(work, f"{name}.json")
    if path and (got := load_json(path, key)) is not None:
        return got
    value = make()
    if path:
        save_json(path, key, value)
    return value


def _generate(runner, key: dict, work, name: str, ids: list[list[int]], max_tokens: int,
              batch: int) -> list[Item]:  # fmt: skip
    shards = Shards(work, name, key | {"max_tokens": max_tokens})
    return shards.run(ids, lambda chunk: responses_and_features(runner, chunk, max_tokens, batch))


def training_items(runner, tok, mix: Mix, max_tokens: int, seed: int, work: str | None,
                   key: dict, batch: int = 128) -> tuple[list[Item], dict[str, int]]:  # fmt: skip
    """The training items of ``mix`` (see the module docstring) -> (items, how many each
    source gave). ``key`` names the target; what ``work`` keeps is reused under the same key."""
    n = mix.counts()
    key = key | {"version": VERSION, "seed": seed}
    keep = magpie.TurnFilter(evalsets.eval_overlap())
    convs = {"templates": templates.prompts(n["templates"], seed, held_out=False)}
    for c in convs["templates"]:
        keep(c[-1]["content"])  # seen: no written prompt repeats one
    pkg = package_text.prompts(2 * n["package"], seed)
    convs["package"] = [c for c in pkg if keep(c[0]["content"])][: n["package"]]
    written = lambda: magpie.user_prompts(runner, tok, n["magpie"], seed, keep)  # noqa: E731
    convs["magpie"] = _cached(work, "magpie", key | {"n": n["magpie"]}, written)
    for c in convs["magpie"]:
        keep(c[0]["content"])  # a reloaded list: seen too
    single = convs["templates"] + convs["package"] + convs["magpie"]
    log(f"prompts: {len(convs['magpie'])} written by the target, {len(convs['templates'])}"
        f" templated, {len(convs['package'])} around package text")  # fmt: skip
    ids = [tok.encode_chat(c) for c in single]
    items = _generate(runner, key | {"n": n}, work, "single", ids, max_tokens, batch)
    eos = set(runner.config.eos_token_ids)
    rng, want = random.Random(seed), min(len(items), int(n["multi_turn"] * 1.3) + 4)
    ended = [i for i, (t, _, p) in enumerate(items) if int(t[-1]) in eos and len(t) > p + 1]
    cut = [i for i in range(len(items)) if i not in set(ended)]  # responses cut at max_tokens
    picked = sorted(rng.sample(ended, min(len(ended), want)))
    picked = sorted(picked + rng.sample(cut, min(len(cut), want - len(picked))))

    def conversations():
        base = [single[i] + [{"role": "assistant",
                              "content": tok.decode(items[i][0][items[i][2] :].tolist())}]
                for i in picked]  # fmt: skip
        more = magpie.follow_ups(runner, tok, base, seed, keep)
        return [c for c in more if c is not None][: n["multi_turn"]]

    multi = _cached(work, "multi_turn", key | {"n": n}, conversations)
    ids = [tok.encode_chat(c) for c in multi]
    items += _generate(runner, key | {"n": n}, work, "multi", ids, max_tokens, batch)
    counts = {k: len(v) for k, v in convs.items()} | {"multi_turn": len(multi)}
    return items, counts


def eval_items(runner, tok, name: str, n: int, max_tokens: int, seed: int, work: str | None,
               key: dict, batch: int = 128) -> list[Item]:  # fmt: skip
    """An evaluation set's items (:mod:`.evalsets`): its prompts and the target's responses."""
    ids = [tok.encode_chat(c) for c in evalsets.conversations(name, n, seed)]
    return _generate(runner, key | {"set": name, "seed": seed}, work, f"eval-{name}", ids,
                     max_tokens, batch)  # fmt: skip
