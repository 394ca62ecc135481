"""The one dtype table of the runtime, built on kvtransfer's (name -> bytes per element).

Names are what configs, stage parameters and KV layouts say (``"float32"``, ``"float16"``, ...).
``MODEL_DTYPES`` are the ones a model runs in, ``KV_CACHE_DTYPES`` the choices of a KV cache's
(``auto``: the model's); a KV pool may hold any ``DTYPE_SIZES`` name. The names import without
torch, so that checking stage parameters (``scripts/make_repo.py``, run at every ``serve.sh``
start) does not load it: 0.2 s against 2 s. :func:`torch_dtype` maps a name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtransfer import DTYPE_SIZES

if TYPE_CHECKING:
    import torch

MODEL_DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "float8_e4m3fn")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a dtype name in ``DTYPE_SIZES``."""
    import torch

    if name not in DTYPE_SIZES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_SIZES)}, got {name!r}")
    return getattr(torch, name)


def model_dtype(name: str) -> torch.dtype:
    """The torch dtype of a model dtype name; ValueError naming the choices otherwise."""
    if name not in MODEL_DTYPES:
        raise ValueError(f"dtype must be one of {list(MODEL_DTYPES)}, got {name!r}")
    return torch_dtype(name)
