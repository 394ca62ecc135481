"""The one dtype table of the runtime, built on kvtransfer's (name -> bytes per element).

Names are what configs, stage parameters and KV layouts say (``"float32"``, ``"float16"``, ...).
``MODEL_DTYPES`` are the ones a model runs in; a KV pool may hold any ``TORCH_DTYPES`` name.
"""

from __future__ import annotations

import torch

from kvtransfer import DTYPE_SIZES

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_SIZES}
MODEL_DTYPES = ("float32", "bfloat16", "float16")


def model_dtype(name: str) -> torch.dtype:
    """The torch dtype of a model dtype name; ValueError naming the choices otherwise."""
    if name not in MODEL_DTYPES:
        raise ValueError(f"dtype must be one of {list(MODEL_DTYPES)}, got {name!r}")
    return TORCH_DTYPES[name]
