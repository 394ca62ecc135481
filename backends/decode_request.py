"""A decode request, the events it emits, and its state inside the decode worker."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .sampler import SamplingParams

PREFIX_WINDOW = 8  # earlier tokens sent along with new ones, for incremental detokenization


@dataclass
class DecodeRequest:
    room: int
    prompt_ids: list[int]
    params: SamplingParams
    bootstrap_addrs: list[str]
    stream: bool = True


@dataclass
class DecodeEvent:
    token_ids: list[int]  # new tokens (all of them when stream=False)
    prefix_ids: list[int]  # up to PREFIX_WINDOW tokens emitted before token_ids
    final: bool = False
    error: str | None = None
    finish_reason: str | None = None


Emit = Callable[[DecodeEvent], None]


@dataclass
class ActiveRequest:
    req: DecodeRequest
    emit: Emit
    is_cancelled: Callable[[], bool] | None
    pages: dict[str, list[int]] = field(default_factory=dict)  # role -> pages ("target", DRAFT)
    phase: str = "waiting"  # waiting (pages) -> transfer -> running -> done
    cancelled: bool = False
    out_ids: list[int] = field(default_factory=list)
    t: dict = field(default_factory=dict)


def noop(*_args) -> None:
    pass


def always() -> bool:
    return True


def cancel_requested(r: ActiveRequest) -> bool:
    if r.cancelled or r.is_cancelled is None:
        return False
    try:
        return bool(r.is_cancelled())
    except Exception:
        return True
