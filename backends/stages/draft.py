"""Speculative decoding in the stages (no Triton): the draft each stage holds, its KV pool, stats.

With ``spec_enabled`` both stages build the same draft from the same parameters:

* **prefill** runs the draft over the prompt after the target's layer groups and sends the draft
  pool's pages as the room's second kvtransfer entry (role ``"draft"``, its own layout: e.g. an
  MLA target with a GQA draft); the room completes only after both entries' KV landed. A
  self-draft's prompt KV equals the target's KV of its first layers: it is copied, not recomputed;
* **decode** registers destination pages in its draft pool next to the target's and runs a
  :class:`~backends.runtime.spec.SpecEngine` that starts from the transferred draft KV.

Prefill and decode must agree on on/off and on the draft: each side checks the other's entries
at the handshake, so a mismatch fails the room with a message naming the ``draft`` entry (one side
without a draft entry, or a draft layout that differs, e.g. another ``draft_layers``).
"""

from __future__ import annotations

import torch

from kvtransfer import reason_of

from ..runtime.draft_policy import AdaptiveDrafting
from ..runtime.eagle import head_config
from ..runtime.kv_pool import KVPool
from ..runtime.runner import ModelRunner
from ..runtime.spec import load_draft
from .params import StageParams

DRAFT = "draft"  # kvtransfer entry role of the draft KV


def load_stage_draft(params: StageParams, target: ModelRunner) -> ModelRunner | None:
    """The draft of this stage, or None when speculative decoding is off."""
    if not params.spec_enabled:
        return None
    draft = _load_stage_draft(params, target)
    cfg = getattr(draft, "config", None)
    if cfg is not None and getattr(cfg, "window_kv_layers", ()):
        raise ValueError(
            "a draft with sliding-window and full-attention layers keeps a window entry of its"
            " own, which the stages do not move yet: use a draft without sliding layers (or a"
            " self-draft of full-attention layers only), or spec_enabled: false"
        )
    return draft


def _load_stage_draft(params: StageParams, target: ModelRunner) -> ModelRunner | None:
    if params.draft_path:
        if head_config(params.draft_path) is not None and params.tensor_parallel_size > 1:
            raise ValueError(
                "an EAGLE head (draft_model_dir) reads the target's features, which"
                " tensor_parallel_size > 1 does not return yet"
            )
        try:
            return load_draft(
                target, path=params.draft_path, tensor_parallel_size=params.tensor_parallel_size
            )
        except (OSError, ValueError) as e:
            raise ValueError(f"parameter draft_model_dir {params.draft_model_dir!r}: {e}") from e
    if params.tensor_parallel_size > 1:
        raise ValueError(
            "a self-draft (draft_layers) shares the target's layers, which tensor_parallel_size"
            " > 1 splits over processes: give tensor-parallel stages a draft checkpoint"
            " (draft_model_dir)"
        )
    n = target.config.num_layers
    if params.draft_layers >= n:
        raise ValueError(
            f"parameter draft_layers ({params.draft_layers}) must be smaller than the target's"
            f" {n} layers (a self-draft keeps the first draft_layers layers)"
        )
    return load_draft(target, num_layers=params.draft_layers)


def shares_target_layers(draft: ModelRunner, target: ModelRunner) -> bool:
    """True for a self-draft: its layers ARE the target's first layers (same weights)."""
    layers = draft.model.layers
    return len(layers) <= len(target.model.layers) and all(
        a is b for a, b in zip(layers, target.model.layers, strict=False)
    )


def copy_prefix_kv(src: KVPool, src_pages: list[int], dst: KVPool, dst_pages: list[int]) -> None:
    """Copy the first ``dst.layout.num_layers`` layers of ``src_pages`` into ``dst_pages``.

    A self-draft's prompt KV is the target's KV of its first K layers (same weights, same
    inputs), so prefill copies it instead of running those layers again.
    """
    n = dst.layout.num_layers
    dim = 2 if src.layout.attn == "gqa" else 1  # [L][2][pages, ps, h, d] or [L][pages, ps, D]
    src_b, dst_b = src.tensor.view(torch.uint8), dst.tensor.view(torch.uint8)  # any dtype (fp8)
    data = src_b[:n].index_select(dim, torch.tensor(src_pages, device=src.tensor.device))
    dst_b.index_copy_(dim, torch.tensor(dst_pages, device=dst.tensor.device), data)


def draft_policy(params: StageParams) -> AdaptiveDrafting | None:
    """Decode's adaptive drafting parameters (None: ``spec_adaptive`` off, always draft)."""
    if not params.spec_adaptive:
        return None
    return AdaptiveDrafting(probe_interval=params.spec_probe_interval)


def make_draft_pool(params: StageParams, draft: ModelRunner) -> KVPool:
    """The draft's KV pool: as many pages of the same page size as the target's pool."""
    return draft.make_pool(params.num_pages, params.page_size, role=DRAFT)


def explain_failure(reason: str) -> str:
    """Add the likely cause to a room failure about the draft entry (decode's error message).

    The one place in the stages that reads a failure's words, because a room failure reaches
    decode as text only: a prefill's ``Fail`` crosses the wire as a reason string (another
    process), and the receiver's layout refusal is its own text. kvtransfer parses its own
    incompatibility messages (``reason_of``); the layout check's words are matched here. It only
    adds a hint to the message: nothing is decided by it."""
    if reason_of(reason) == "draft" or ("incompatible layout" in reason and DRAFT in reason):
        return (
            f"{reason} (speculative decoding must be configured identically in prefill and"
            " decode: spec_enabled, draft_model_dir / draft_layers)"
        )
    return reason


def spec_stats(engine) -> dict:
    """Cumulative acceptance counters of a SpecEngine (for the stage metrics)."""
    st = engine.stats
    return {
        "spec_proposed": st.proposed,
        "spec_accepted": st.accepted,
        "spec_verify_steps": st.verify_steps,
        "spec_acceptance_rate": st.acceptance_rate,
        "spec_mean_accepted_length": st.mean_accepted_length,
        "spec_undrafted_steps": st.undrafted_steps,
        "spec_switched_off": st.switched_off,
        "spec_branch_kept": st.branch_kept,
    }
