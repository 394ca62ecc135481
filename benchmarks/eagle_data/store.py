"""Where training data waits between runs: safetensors shards of (tokens, features, prompt
length) items, and JSON files of prompts, each tagged with the key of what made it (target,
prompts, lengths, seed, ...). A shard or a file under another key reads as absent, so a changed
setting recomputes what it changes and an interrupted run redoes only its unfinished shard."""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch

Item = tuple[torch.Tensor, torch.Tensor, int]  # tokens [T], features [T - 1, H], prompt length


def log(msg: str) -> None:
    print(f"[train_eagle] {msg}", file=sys.stderr, flush=True)


def _key(key: dict) -> str:
    return json.dumps(key, sort_keys=True)


def save(path: str, key: dict, items: list[Item]) -> None:
    """Keep (tokens, features, prompt length) items in a safetensors file tagged with ``key``
    (written to a temporary name, then renamed: a killed write leaves no shard)."""
    from safetensors.torch import save_file

    tensors = {}
    for i, (tokens, feats, plen) in enumerate(items):
        tensors |= {f"{i}.tokens": tokens.contiguous(), f"{i}.feats": feats.contiguous(),
                    f"{i}.plen": torch.tensor([plen])}  # fmt: skip
    save_file(tensors, path + ".tmp", metadata={"key": _key(key), "items": str(len(items))})
    os.replace(path + ".tmp", path)


def load(path: str, key: dict) -> list[Item] | None:
    """The items :func:`save` kept at ``path`` under the same ``key``, else None."""
    from safetensors import safe_open

    if not os.path.exists(path):
        return None
    with safe_open(path, "pt") as f:
        if f.metadata().get("key") != _key(key):
            return None
        n = len(list(f.keys())) // 3
        return [(f.get_tensor(f"{i}.tokens"), f.get_tensor(f"{i}.feats"),
                 int(f.get_tensor(f"{i}.plen")[0])) for i in range(n)]  # fmt: skip


def save_json(path: str, key: dict, value) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump({"key": key, "value": value}, f)
    os.replace(path + ".tmp", path)


def load_json(path: str, key: dict):
    """What :func:`save_json` kept at ``path`` under the same ``key``, else None."""
    try:
        with open(path) as f:
            got = json.load(f)
    except (OSError, ValueError):
        return None
    return got["value"] if _key(got.get("key", {})) == _key(key) else None


class Shards:
    """Items made in chunks of ``size`` inputs under ``dir``: :meth:`run` makes only the chunks
    that have no shard under ``key`` yet, and returns every chunk's items in order."""

    def __init__(self, dir: str | None, name: str, key: dict, size: int = 1024):
        self.dir, self.name, self.key, self.size = dir, name, key, size

    def run(self, inputs: list, make) -> list[Item]:
        out: list[Item] = []
        for c in range(0, len(inputs), self.size):
            chunk = inputs[c : c + self.size]
            digest = hashlib.sha256(json.dumps(chunk).encode()).hexdigest()[:16]
            key = self.key | {"chunk": c // self.size, "inputs": digest}
            path = self.dir and os.path.join(self.dir, f"{self.name}-{c // self.size:04d}.st")
            items = load(path, key) if path else None
            if items is None:
                log(f"{self.name}: chunk {c // self.size + 1}/{-(-len(inputs) // self.size)}")
                items = make(chunk)
                if path:
                    save(path, key, items)
            out += items
        return out
