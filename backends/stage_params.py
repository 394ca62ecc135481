"""Stage parameters: config.pbtxt ``parameters`` parsed and validated once, into a frozen dataclass.

Every stage (preprocess, prefill, decode, postprocess) reads the same schema; each stage uses the
fields it needs. Values arrive from Triton as strings; :func:`parse_params` converts them and
raises ``ValueError`` naming the parameter and what it accepts, so a bad config fails model load.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields

from kvtransfer import LayerGroupPolicy, TransferConfig

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = "models/smollm2-135m-instruct"
DTYPES = ("float32", "bfloat16")
TRANSPORTS = ("tcp", "rdma")


@dataclass(frozen=True)
class StageParams:
    model_dir: str = DEFAULT_MODEL  # checkpoint directory; relative paths are from the repo root
    dtype: str = "float32"
    device: str = "cpu"
    page_size: int = 16  # tokens per KV page (prefill and decode must agree)
    num_pages: int = 512  # KV pool size of this stage, in pages
    max_batch: int = 16  # decode: sequences per continuous-batching step
    max_context: int = 2048  # prompt + max_tokens limit (tokens)
    max_tokens_limit: int = 1024  # largest max_tokens a request may ask for
    lg_enabled: bool = True  # layer-grouped KV streaming on/off
    lg_min_tokens: int = 256
    lg_min_groups: int = 2
    lg_max_groups: int = 8
    lg_sat_multiplier: float = 16.0
    lg_fixed_group_size: int = 0  # 0: adaptive policy; N: groups of N layers
    transport: str = "tcp"
    rdma_device: str = ""
    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int = 0  # prefill: 0 = any free port; N = N + instance index
    bootstrap_timeout_s: float = 30.0
    transfer_timeout_s: float = 120.0
    shared_secret: str = ""  # >= 16 chars enables HMAC on control messages
    trace_dir: str = ""  # when set, stages append per-request timing JSON lines here
    # speculative decoding (prefill and decode must be configured identically)
    spec_enabled: bool = False  # prefill sends the draft's prompt KV; decode drafts + verifies
    draft_model_dir: str = ""  # draft checkpoint; "" = self-draft (target's first draft_layers)
    draft_layers: int = 24  # self-draft: number of the target's layers the draft keeps
    spec_tokens: int = 2  # draft tokens proposed per verify step (k)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"parameter dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"parameter transport must be one of {TRANSPORTS}, got {self.transport!r}"
            )
        positive = ("page_size", "num_pages", "max_batch", "max_context", "max_tokens_limit")
        for name in (*positive, "draft_layers", "spec_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"parameter {name} must be an integer >= 1, got {getattr(self, name)}"
                )
        if self.max_tokens_limit >= self.max_context:
            raise ValueError(
                f"parameter max_tokens_limit ({self.max_tokens_limit}) must be smaller than"
                f" max_context ({self.max_context}): a prompt needs at least one token"
            )
        if self.lg_fixed_group_size < 0:
            raise ValueError("parameter lg_fixed_group_size must be >= 0 (0 = adaptive policy)")
        self.policy()  # LayerGroupPolicy checks its own ranges
        self.transfer_config()  # and TransferConfig its own

    @property
    def model_path(self) -> str:
        return (
            self.model_dir
            if os.path.isabs(self.model_dir)
            else os.path.join(REPO_ROOT, self.model_dir)
        )

    @property
    def draft_path(self) -> str | None:
        """The draft checkpoint directory (absolute), or None for a self-draft."""
        if not self.draft_model_dir:
            return None
        d = self.draft_model_dir
        return d if os.path.isabs(d) else os.path.join(REPO_ROOT, d)

    def policy(self) -> LayerGroupPolicy:
        try:
            return LayerGroupPolicy(
                min_tokens=self.lg_min_tokens,
                min_groups=self.lg_min_groups,
                max_groups=self.lg_max_groups,
                sat_multiplier=self.lg_sat_multiplier,
                fixed_group_size=self.lg_fixed_group_size or None,
                enabled=self.lg_enabled,
            )
        except ValueError as e:
            raise ValueError(f"layer-group parameters (lg_*): {e}") from None

    def transfer_config(self, instance_index: int = 0) -> TransferConfig:
        port = self.bootstrap_port + instance_index if self.bootstrap_port else 0
        try:
            return TransferConfig(
                host=self.bootstrap_host,
                bootstrap_port=port,
                protocol=self.transport,
                rdma_device=self.rdma_device,
                bootstrap_timeout_s=self.bootstrap_timeout_s,
                transfer_timeout_s=self.transfer_timeout_s,
                shared_secret=self.shared_secret or None,
            )
        except ValueError as e:
            raise ValueError(f"transfer parameters: {e}") from None


def _convert(name: str, typ: type, raw: str):
    raw = raw.strip()
    if typ is bool:
        low = raw.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"parameter {name} must be true or false, got {raw!r}")
    if typ is int:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"parameter {name} must be an integer, got {raw!r}") from None
    if typ is float:
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"parameter {name} must be a number, got {raw!r}") from None
    return raw


_TYPES = {
    f.name: {"str": str, "int": int, "float": float, "bool": bool}[f.type]
    for f in fields(StageParams)
}


def parse_params(raw: dict[str, str]) -> StageParams:
    """``raw``: name -> string value (unknown names are an error: typos fail loudly)."""
    unknown = sorted(set(raw) - set(_TYPES))
    if unknown:
        raise ValueError(f"unknown parameter(s) {unknown}; known: {sorted(_TYPES)}")
    values = {k: _convert(k, _TYPES[k], str(v)) for k, v in raw.items()}
    return StageParams(**values)


def from_triton_config(model_config: str | dict) -> StageParams:
    """Parse the ``parameters`` of a Triton model config (JSON string or dict)."""
    cfg = json.loads(model_config) if isinstance(model_config, str) else model_config
    raw = {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}
    return parse_params(raw)


def instance_index(instance_name: str) -> int:
    """Triton names instances ``<model>_<group>_<index>``; returns the trailing index (else 0)."""
    tail = instance_name.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else 0
