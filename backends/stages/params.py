"""Stage parameters: ONE schema for every stage's ``config.pbtxt`` ``parameters``.

Each field has its default (the only definition of it: transfer and layer-group defaults are read
from :class:`~kvtransfer.TransferConfig` and :class:`~.policy.LayerGroupPolicy`), the stages
that use it, and its documentation; ``docs/configuration.md`` is generated from this schema
(``scripts/gen_docs.py``, checked by a test). Values arrive from Triton as strings:
:func:`parse_params` converts them and raises ``ValueError`` naming the parameter and what it
accepts, so a bad config fails the model load. A ``config.pbtxt`` lists only what it sets.

A leaf: no I/O, and no stage module but the layer-group policy's dataclass and the secret rule
(:mod:`.keys`). What needs the checkpoint's files (the deployment identity, :mod:`.fingerprint`)
is computed by a stage and passed in (:meth:`StageParams.transfer_config`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, fields, replace

from kvtransfer import PROTOCOLS, Identity, TransferConfig

from ..runtime.draft_policy import AdaptiveDrafting
from ..runtime.dtypes import KV_CACHE_DTYPES, MODEL_DTYPES
from .keys import refuse_weak
from .policy import LayerGroupPolicy

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_MODEL = "models/smollm2-135m-instruct"
STAGES = ("preprocess", "prefill", "decode", "postprocess", "router")
MODEL_STAGES = ("preprocess", "prefill", "decode", "postprocess")  # the ones that read the model
PD = ("prefill", "decode")
ROUTED = ("router", "decode")  # a decode server's router (and decode's failover re-dispatch)
# what a deployment's fingerprint is made of: the router needs it too, to check prefill servers
IDENTITY = (*MODEL_STAGES, "router")
PDR = (*PD, "router")
_TC, _LG = TransferConfig, LayerGroupPolicy  # dataclass defaults are class attributes
SECRET_ENV = "PD_SHARED_SECRET"


def _p(default, stages: tuple[str, ...], doc: str):
    return field(default=default, metadata={"stages": stages, "doc": doc})


@dataclass(frozen=True)
class StageParams:
    model_dir: str = _p(
        DEFAULT_MODEL,
        IDENTITY,
        "HF checkpoint directory (relative to the repository root, or absolute)",
    )
    dtype: str = _p("float32", PDR, f"model and KV dtype: {' or '.join(MODEL_DTYPES)}")
    kv_cache_dtype: str = _p(
        "auto",
        PDR,
        "`auto` (the model's `dtype`) or `float8_e4m3fn`: fp8 KV with calibrated per-layer scales"
        " (half of bfloat16's bytes in the pool and on the wire); prefill and decode must agree,"
        " scales included (checked at handshake)",
    )
    device: str = _p(
        "auto",
        PD,
        "`auto` (the instance's GPU with `KIND_GPU`, else `cuda:0` when torch sees a GPU, else"
        " `cpu`), `cpu`, `cuda`, `cuda:N`; the log names the device chosen",
    )
    page_size: int = _p(
        16, PDR, "tokens per KV page; prefill and decode must agree (checked at handshake)"
    )
    num_pages: int = _p(512, PD, "KV pool pages per instance")
    tensor_parallel_size: int = _p(
        1,
        PD,
        "ranks of the stage's model: rank 0 in the instance, 1..N-1 worker processes it owns"
        " (GPUs: the instance's device and the next N-1)",
    )
    max_batch: int = _p(16, ("decode",), "sequences per continuous-batching step")
    state_slots: int = _p(
        0,
        PD,
        "state slots of a hybrid model's recurrent layers (gated DeltaNet, Mamba2): one a request"
        " from its pages' allocation to its end, a fixed size whatever its length (the stage logs"
        " the bytes a slot holds); 0: twice `max_batch`",
    )
    max_context: int = _p(2048, ("preprocess", "decode"), "limit on prompt + `max_tokens`")
    max_tokens_limit: int = _p(
        1024,
        ("preprocess", "decode"),
        "largest `max_tokens` a request may ask for (< `max_context`)",
    )
    default_max_tokens: int = _p(
        256,
        ("preprocess",),
        "`max_tokens` of a request that gives none (capped by `max_tokens_limit` and context left)",
    )
    max_prefill_tokens: int = _p(
        4096,
        ("prefill",),
        "prompt tokens per prefill forward; a longer prompt goes in chunks of it (chunked prefill)",
    )
    prefill_batch_tokens: int = _p(
        512,
        ("prefill",),
        "rooms decode registered are batched while their prompts fit it (each member's first token"
        " waits for the whole batch); capped by `max_prefill_tokens`",
    )
    prefix_cache: str = _p(
        "auto",
        PDR,  # the router weighs decode's likely hits only when decode keeps a cache
        "reuse the KV of prompt prefixes (page-aligned blocks): prefill computes only what its"
        " cache lacks, decode registers only what its cache lacks and prefill sends only that;"
        " `auto` = on where the model can be cached by page (not for recurrent or sliding-window"
        " layers, or an EAGLE head), `on` = refuse such a model at load, `off`",
    )
    prefix_cache_share: float = _p(
        0.5, PD, "at most this fraction of the KV pool holds cached blocks (LRU eviction)"
    )
    kv_events_endpoint: str = _p(
        "",
        PD,
        "publish the prefix cache's blocks as vLLM-format KV events (ZMQ PUB, msgpack"
        " `KVEventBatch`) on this endpoint, e.g. `tcp://10.0.0.5:5557`, for llm-d's or Dynamo's"
        " KV-aware routers; empty = off",
    )
    kv_events_connect: bool = _p(
        False,
        PD,
        "`false`: the stage listens on `kv_events_endpoint` (subscribers such as Dynamo's KV"
        " router connect); `true`: it connects there (a router whose SUB socket listens, as"
        " llm-d's scheduler does)",
    )
    kv_events_replay_endpoint: str = _p(
        "", PD, "the KV events' replay socket (ROUTER: a subscriber asks from a sequence number)"
    )
    kv_events_topic: str = _p("", PD, "the KV events' topic (default: empty, every subscriber)")
    prefill_gather_ms: float = _p(
        20.0,
        ("prefill",),
        "a forward waits at most this long for rooms submitted as long ago that decode has not"
        " registered yet, to batch a burst; 0 = off",
    )
    lg_enabled: bool = _p(
        _LG.enabled,
        ("prefill",),
        "layer-grouped KV streaming; `false` sends the whole KV after prefill",
    )
    lg_min_tokens: int = _p(_LG.min_tokens, ("prefill",), "prompts shorter than this: 1 group")
    lg_min_groups: int = _p(
        _LG.min_groups,
        ("prefill",),
        "groups at and above `lg_sat_multiplier` x `lg_min_tokens` tokens",
    )
    lg_max_groups: int = _p(_LG.max_groups, ("prefill",), "groups at `lg_min_tokens` tokens")
    lg_sat_multiplier: float = _p(
        _LG.sat_multiplier, ("prefill",), "where the group count reaches `lg_min_groups`"
    )
    lg_fixed_group_size: int = _p(0, ("prefill",), "`0` = adaptive; `N` = groups of N layers")
    transport: str = _p(
        _TC.protocol,
        PD,
        "Mooncake protocol, `tcp` or `rdma` (`serve.sh` sets `MC_FORCE_TCP=1` unless set)",
    )
    rdma_device: str = _p(_TC.rdma_device, PD, "RDMA NIC, e.g. `mlx5_0` (with `transport: rdma`)")
    bootstrap_host: str = _p(
        _TC.host, PD, "address the control sockets, Mooncake and decode's cancel listener bind to"
    )
    bootstrap_port: int = _p(
        _TC.bootstrap_port, ("prefill",), "`0` = any free port; `N` = port N + instance index"
    )
    bootstrap_timeout_s: float = _p(
        _TC.bootstrap_timeout_s, PD, "how long a room may wait for the peer's registration / claim"
    )
    transfer_timeout_s: float = _p(
        _TC.transfer_timeout_s, PD, "claim -> completion limit; also prefill's wait for free pages"
    )
    shared_secret: str = _p(
        "",
        ("prefill", "decode", "postprocess", "router"),
        "HMAC-SHA256 key of every control and cancel message; empty = the"
        f" `{SECRET_ENV}` environment variable (`serve.sh` sets a random one per start); a weak"
        " one (under 16 characters, under 8 different ones, a repeated piece, the manifest's"
        " placeholder) fails the load: make one with `openssl rand -hex 32`",
    )
    allow_insecure: bool = _p(
        False,
        PD,
        "allow a non-loopback `bootstrap_host` without a shared secret (unsigned control messages"
        " on the network); without it such a config fails the load",
    )
    max_queue: int = _p(
        4096,
        PD,
        "requests a stage holds waiting (prefill: for decode's pages or for compute; decode: for"
        " KV pages); past it new requests get `overloaded, retry later` (UNAVAILABLE) at once; a"
        " waiting request costs only its prompt ids (bursts queue)",
    )
    queue_timeout_s: float = _p(
        _TC.queue_timeout_s,
        PD,
        "how long a request may wait in a queue before anything is computed for it; past it it"
        " ends `overloaded, retry later`",
    )
    reload_generation: int = _p(
        0,
        STAGES,
        "no effect on serving: `scripts/supervise.py` raises it (in a load request's config) to"
        " make Triton reload a stage whose process died while the old version serves on",
    )
    trace_dir: str = _p(
        "",
        PD,
        "when set, per-room timing JSON lines (register, groups computed / landed, first token)",
    )
    spec_enabled: bool = _p(
        False,
        PDR,
        "speculative decoding: prefill also sends the draft's prompt KV, decode drafts and"
        " verifies; must be equal in both stages (checked at handshake)",
    )
    draft_model_dir: str = _p(
        "",
        PDR,
        "draft checkpoint (a supported family with the target's vocabulary) or an EAGLE head"
        ' (scripts/train_eagle.py); `""` = self-draft',
    )
    draft_layers: int = _p(
        24,
        PDR,
        "self-draft: keep the target's first N layers (+ final norm and head); < target layers",
    )
    spec_tokens: int = _p(2, ("decode",), "draft tokens proposed per verify step (k)")
    spec_max_batch: int = _p(
        2,
        ("decode",),
        "a step of more running sequences drafts nothing (on CPU, k + 1 verify rows each then cost"
        " more than they save, see docs/serving.md); 0 = no limit (GPUs)",
    )
    spec_adaptive: bool = _p(
        True,
        ("decode",),
        "decode measures, online, each sequence's tokens per verify step and the cost of a"
        " drafted step against a plain one, and stops drafting for a sequence (and for new ones,"
        " server-wide) while drafting does not pay; it probes again now and then and resumes when"
        " it pays (backends/runtime/draft_policy.py; lossless either way); false = always draft",
    )
    spec_min_confidence: float = _p(
        0.35,
        ("decode",),
        "a sequence's draft chain ends early, before spec_tokens drafts, once the product of the"
        " draft's probabilities of its drafts falls under this (fewer head calls and verify rows"
        " where the draft is unsure; lossless); 0 = always spec_tokens drafts",
    )
    spec_branches: int = _p(
        1,
        ("decode",),
        "with an EAGLE head: draft chains per greedy sequence, the head's first choice's and one"
        " for each next best first token; the target verifies them side by side (as rows of"
        " its forward) and keeps the one that starts right (lossless; backends/runtime/"
        "spec_branches.py); 1 = one chain",
    )
    spec_max_drafts: int = _p(
        0,
        ("decode",),
        "the drafts a sequence's chains verify at most in a step, its most confident ones (the"
        " draft's probability products; lossless): on a CPU a verify of up to 6 rows costs"
        " little more than one row and a 7th adds about 4 ms (docs/serving.md); 0 = no limit",
    )
    spec_probe_interval: int = _p(
        AdaptiveDrafting.probe_interval,
        ("decode",),
        "with `spec_adaptive`: steps a sequence decodes without drafting before it probes (drafts"
        " a few steps to re-measure); doubles after each failed probe, up to 8x",
    )
    prefill_servers: str = _p(
        "",
        ROUTED,
        "decode server role: the prefill servers, `HOST:GRPC_PORT[:METRICS_PORT],...` (metrics"
        " port default GRPC_PORT + 1); the router forwards each request to the one with the fewest"
        " queued prompt tokens; `serve.sh --prefill-servers` sets it",
    )
    route_timeout_s: float = _p(
        10.0,
        ROUTED,
        "how long a prefill server may take to accept a forwarded request (and to answer a probe:"
        " 1/4 of it); past it the server is marked down and the next one is tried",
    )
    probe_interval_s: float = _p(
        0.5,
        ROUTED,
        "the router polls each prefill server's queue metric (and probes a server marked down for"
        " readiness) this often",
    )
    local_prefill_max_tokens: int = _p(
        0,
        ("router",),
        "conditional disaggregation: prompts of which at most this many tokens are not in the"
        " decode server's prefix cache (as far as its router knows) are prefilled by the decode"
        " server itself (no KV transfer); `0` = never; very high = colocated serving",
    )
    route_policy: str = _p(
        "cache",
        ROUTED,
        "how the router picks a prefill server: `cache` = fewest queued tokens plus prompt tokens"
        " it would compute (the blocks of prompts routed to it before count as cached), `queue` ="
        " fewest queued tokens",
    )
    local_prefill_busy_tokens: int = _p(
        0,
        ("router",),
        "prefill locally too when every prefill server that is up has more queued prompt tokens"
        " than this (or none is up); `0` = never for load",
    )
    kv_checksum: bool = _p(
        False,
        PDR,
        "end-to-end KV integrity: prefill sends a CRC32C per entry and layer, decode verifies the"
        " landed bytes before the request decodes; a mismatch fails the room (re-dispatched on a"
        " decode server); must be equal in prefill and decode (checked at first contact)",
    )
    failover_attempts: int = _p(
        3,
        ("decode",),
        "times decode re-dispatches a request whose prefill server died, hung or refused before"
        " its KV completed (under a fresh room, to another prefill server)",
    )

    def __post_init__(self) -> None:
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"parameter dtype must be one of {MODEL_DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"parameter kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got"
                f" {self.kv_cache_dtype!r}"
            )
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(
                f"parameter device must be auto, cpu, cuda or cuda:N, got {self.device!r}"
            )
        if self.transport not in PROTOCOLS:
            raise ValueError(
                f"parameter transport must be one of {PROTOCOLS}, got {self.transport!r}"
            )
        positive = (
            "page_size",
            "num_pages",
            "max_batch",
            "max_context",
            "max_tokens_limit",
            "max_queue",
            "default_max_tokens",
            "max_prefill_tokens",
            "prefill_batch_tokens",
            "tensor_parallel_size",
        )
        for name in (*positive, "draft_layers", "spec_tokens", "spec_probe_interval",
                     "spec_branches", "failover_attempts"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(
                    f"parameter {name} must be an integer >= 1, got {getattr(self, name)}"
                )
        if self.max_tokens_limit >= self.max_context:
            raise ValueError(
                f"parameter max_tokens_limit ({self.max_tokens_limit}) must be smaller than"
                f" max_context ({self.max_context}): a prompt needs at least one token"
            )
        zero_is_off = (
            "lg_fixed_group_size",
            "local_prefill_max_tokens",
            "local_prefill_busy_tokens",
            "prefill_gather_ms",
            "spec_max_drafts",
        )
        for name in zero_is_off:
            if getattr(self, name) < 0:
                raise ValueError(f"parameter {name} must be >= 0 (0 = off)")
        if self.route_policy not in ("cache", "queue"):
            raise ValueError(
                f"parameter route_policy must be cache or queue, got {self.route_policy!r}"
            )
        if self.prefix_cache not in ("auto", "on", "off"):
            raise ValueError(
                f"parameter prefix_cache must be auto, on or off, got {self.prefix_cache!r}"
            )
        if not 0 < self.prefix_cache_share <= 1:
            raise ValueError("parameter prefix_cache_share must be in (0, 1]")
        if not 0 <= self.spec_min_confidence < 1:
            raise ValueError("parameter spec_min_confidence must be in [0, 1) (0 = off)")
        if self.route_timeout_s <= 0 or self.probe_interval_s <= 0:
            raise ValueError("parameters route_timeout_s and probe_interval_s must be > 0")
        self.servers()  # prefill_servers parses
        self.policy()  # LayerGroupPolicy checks its own ranges
        if self.secret:  # the parameter, else the environment variable
            what = f"the shared secret (parameter shared_secret or ${SECRET_ENV})"
            refuse_weak(self.secret, what)
        cfg = self.transfer_config()  # and TransferConfig its own
        if not cfg.is_loopback and cfg.shared_secret is None and not self.allow_insecure:
            raise ValueError(
                f"bootstrap_host {self.bootstrap_host} is not a loopback address but no shared"
                f" secret is set: set shared_secret (or {SECRET_ENV}: `openssl rand -hex 32`) on"
                " both stages, or allow_insecure: true to send unsigned control messages"
            )

    @property
    def secret(self) -> str:
        """The shared secret in effect: the parameter, else the environment variable."""
        return self.shared_secret or os.environ.get(SECRET_ENV, "")

    @property
    def model_path(self) -> str:
        return resolve_path(self.model_dir)

    @property
    def draft_path(self) -> str | None:
        """The draft checkpoint directory (absolute), or None for a self-draft."""
        return resolve_path(self.draft_model_dir) if self.draft_model_dir else None

    def servers(self) -> list[tuple[str, int, int]]:
        """``prefill_servers`` as (host, gRPC port, metrics port) triples; ValueError naming the
        bad item."""
        out = []
        for item in filter(None, (x.strip() for x in self.prefill_servers.split(","))):
            parts = item.split(":")
            ok = len(parts) in (2, 3) and parts[0] and all(p.isdigit() for p in parts[1:])
            ports = [int(p) for p in parts[1:]] if ok else []
            if not ok or not all(0 < p < 65536 for p in ports):
                raise ValueError(
                    f"parameter prefill_servers: {item!r} is not HOST:GRPC_PORT[:METRICS_PORT]"
                )
            out.append((parts[0], ports[0], ports[1] if len(ports) == 2 else ports[0] + 1))
        if len({(h, g) for h, g, _ in out}) != len(out):
            raise ValueError(f"parameter prefill_servers lists a server twice: {out}")
        return out

    def on_instance(self, kind: str = "", device_id: int = -1) -> StageParams:
        """These parameters with ``device`` resolved for a serving instance (Triton's
        ``model_instance_kind`` / ``model_instance_device_id``)."""
        from ..runtime.device import resolve_device  # torch: only where a stage runs

        return replace(self, device=resolve_device(self.device, kind, device_id))

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

    def transfer_config(
        self, instance_index: int = 0, identity: Identity | None = None
    ) -> TransferConfig:
        """The kvtransfer settings; ``identity``: the deployment identity they carry (a stage
        computes it, :func:`.fingerprint.deployment_identity`; Register carries it, prefill
        refuses another one: kvtransfer/protocol/identity.py)."""
        port = self.bootstrap_port + instance_index if self.bootstrap_port else 0
        try:
            return TransferConfig(
                host=self.bootstrap_host,
                bootstrap_port=port,
                protocol=self.transport,
                rdma_device=self.rdma_device,
                bootstrap_timeout_s=self.bootstrap_timeout_s,
                transfer_timeout_s=self.transfer_timeout_s,
                queue_timeout_s=self.queue_timeout_s,
                shared_secret=self.secret or None,
                kv_checksum=self.kv_checksum,
                identity=identity,
            )
        except ValueError as e:
            raise ValueError(f"transfer parameters: {e}") from None


def resolve_path(path: str) -> str:
    """Absolute path; relative ones are taken from the repository root."""
    return path if os.path.isabs(path) else os.path.join(REPO_ROOT, path)


SCHEMA = {f.name: f for f in fields(StageParams)}
_CASTS = {"str": str, "int": int, "float": float, "bool": bool}


def stages_of(name: str) -> tuple[str, ...]:
    return SCHEMA[name].metadata["stages"]


def _convert(name: str, raw: str):
    typ = _CASTS[SCHEMA[name].type]
    raw = raw.strip()
    if typ is bool:
        low = raw.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"parameter {name} must be true or false, got {raw!r}")
    try:
        return typ(raw)
    except ValueError:
        what = {int: "an integer", float: "a number"}.get(typ, "a string")
        raise ValueError(f"parameter {name} must be {what}, got {raw!r}") from None


def parse_params(raw: dict[str, str], stage: str | None = None) -> StageParams:
    """``raw``: name -> string value. Unknown names, and with ``stage`` names that stage does
    not use, are errors: a typo or a misplaced setting fails loudly instead of being ignored."""
    unknown = sorted(set(raw) - set(SCHEMA))
    if unknown:
        raise ValueError(f"unknown parameter(s) {unknown}; known: {sorted(SCHEMA)}")
    if stage is not None:
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; stages: {STAGES}")
        foreign = sorted(k for k in raw if stage not in stages_of(k))
        if foreign:
            where = {k: list(stages_of(k)) for k in foreign}
            raise ValueError(
                f"parameter(s) {foreign} do not apply to stage {stage} (used by {where})"
            )
    return StageParams(**{k: _convert(k, str(v)) for k, v in raw.items()})


def from_triton_config(model_config: str | dict, stage: str) -> StageParams:
    """Parse the ``parameters`` of a Triton model config (JSON string or dict) of ``stage``."""
    cfg = json.loads(model_config) if isinstance(model_config, str) else model_config
    raw = {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}
    return parse_params(raw, stage)


def instance_index(instance_name: str) -> int:
    """Triton names instances ``<model>_<group>_<index>``; returns the trailing index (else 0)."""
    tail = instance_name.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def reference_table() -> str:
    """The configuration reference (markdown), generated from the schema."""
    rows = ["| parameter | default | stages | meaning |", "|---|---|---|---|"]
    for name, f in SCHEMA.items():
        d = f.default
        shown = (
            str(d).lower()
            if isinstance(d, bool)
            else ('""' if d == "" else f"{d:g}" if isinstance(d, float) else d)
        )
        rows.append(
            f"| `{name}` | `{shown}` | {', '.join(f.metadata['stages'])} | {f.metadata['doc']} |"
        )
    return "\n".join(rows) + "\n"
