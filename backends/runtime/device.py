"""Devices: what ``auto`` means, and completion fences for work queued on a device.

* :func:`resolve_device`: ``auto`` is ``cuda:<id>`` when the serving instance was given a GPU
  (Triton ``KIND_GPU`` with a device id), else ``cuda:0`` when torch sees a GPU, else ``cpu``.
  An explicit ``cuda`` without an index takes the instance's GPU too. Asking for CUDA where torch
  sees none is an error, not a silent fallback.
* :func:`record_fence`: after a forward is *launched*, its kernels may still run on a CUDA
  stream. The fence (a CUDA event recorded on the current stream) tells a transfer thread when
  the bytes are final; on CPU the bytes are final when the call returns, so there is no fence.
"""

from __future__ import annotations

import torch


def resolve_device(requested: str, instance_kind: str = "", instance_device_id: int = -1) -> str:
    """``requested``: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``; ``instance_kind`` /
    ``instance_device_id``: what the server assigned this instance (``GPU`` and its index)."""
    req = requested.strip().lower()
    gpu = f"cuda:{instance_device_id}" if instance_kind.upper() == "GPU" else ""
    if gpu and instance_device_id < 0:
        raise ValueError("the instance is KIND_GPU but no device id was given")
    if req == "auto":
        if gpu:
            return gpu
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(req)
    except RuntimeError as e:
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {requested!r}") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {requested!r}: torch sees no CUDA device on this host")
        if dev.index is None:
            return gpu or "cuda:0"
        if dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {requested!r}: only {torch.cuda.device_count()} GPUs here")
    elif dev.type != "cpu":
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {requested!r}")
    return str(dev)


def record_fence(device: torch.device | str):
    """A completion fence for everything queued so far on ``device``'s current stream: a CUDA
    event (``query()`` is True once those kernels finished), or None on CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
