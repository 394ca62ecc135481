"""Read a checkpoint's safetensors files into a flat ``name -> tensor`` dict.

Files are found through ``model.safetensors.index.json`` when present, else by globbing
``*.safetensors``. Decoder layers at or beyond ``num_layers`` (a self-draft, or DeepSeek-V3's
multi-token-prediction layer) are skipped without being read. A few checkpoints name what the
runtime reads under another name (:data:`RENAMES`, as transformers' conversion mapping does):
those names are changed as the files are read.
"""

from __future__ import annotations

import glob
import json
import os
import re

import torch
from safetensors import safe_open

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
# (prefix in a checkpoint, the runtime's): Nemotron-H's original "backbone." and "embeddings"
RENAMES = (("backbone.", "model."), ("model.embeddings.", "model.embed_tokens."))


def runtime_name(name: str) -> str:
    """The runtime's name of a checkpoint tensor (see :data:`RENAMES`)."""
    for old, new in RENAMES:
        if name.startswith(old):
            name = new + name[len(old) :]
    return name


def weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, n) for n in names]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(
                f"model directory {path!r}: index lists weight files that are missing: "
                f"{', '.join(os.path.basename(m) for m in missing)}"
            )
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(
            f"no weights in model directory {path!r}: expected model.safetensors, sharded "
            f"*.safetensors files, or model.safetensors.index.json"
        )
    return files


def beyond_layers(name: str, num_layers: int) -> bool:
    """Whether ``name`` is a decoder layer's tensor at or beyond ``num_layers``."""
    m = _LAYER_RE.match(name)
    return m is not None and int(m.group(1)) >= num_layers


def load_weights(
    path: str, num_layers: int, dtype: torch.dtype, device: str | torch.device
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for stored in f.keys():
                name = runtime_name(stored)
                if beyond_layers(name, num_layers):
                    continue
                t = f.get_tensor(stored)
                if t.is_floating_point():
                    t = t.to(dtype)
                out[name] = t.to(device)
    return out


class WeightReader:
    """Hands out tensors by name and reports what a model needs but the checkpoint lacks."""

    def __init__(self, tensors: dict[str, torch.Tensor], source: str):
        self.tensors = tensors
        self.source = source

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> torch.Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"checkpoint {self.source!r} has no tensor {name!r}") from None

    def opt(self, name: str) -> torch.Tensor | None:
        return self.tensors.get(name)
