"""Bytes a room moves per prompt token, for each family's flagship shape, without weights.

Each shape is a transformers config class (its defaults, or the published shape where the
defaults are not a released model: named in ``source``) turned into our ``ModelConfig``, then
into the stage's entry layouts exactly as a stage makes them (``ModelRunner.entry_layout`` of a
runner holding no model, ``StateSpec.entry_layout``): nothing here re-derives a layout. A room
of ``n`` prompt tokens moves, per entry::

    bytes(entry) = count x num_layers x components x page_bytes,   (first, count) = pages_for(n)

every page of ``target`` (full attention), the pages covering the prompt's last window of
``target.window`` (sliding layers), one slot of ``target.state`` (recurrent layers, whatever
``n``). The comparison is the same model with every token-mixing layer (attention, sliding,
recurrent) made full attention of the model's own KV shape: the same width and depth, with the
MLP-only layers (Nemotron-H) holding nothing in both. The KV is in ``kv_dtype`` (bfloat16, as
these models are served); a state slot is float32 whatever the model's dtype (state_pool.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvtransfer import EntryLayout

PAGE_SIZE = 16  # the stages' default (StageParams.page_size)
DEFAULT_LENGTHS = (1024, 8192, 32768)
# the published shapes used where a config class's defaults are no released model
GEMMA_3_4B = dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                  sliding_window=1024)  # fmt: skip
NEMOTRON_NANO_9B_V2 = dict(
    hidden_size=4480, intermediate_size=15680, num_attention_heads=40, num_key_value_heads=8,
    head_dim=128, mamba_num_heads=128, mamba_head_dim=80, n_groups=8, ssm_state_size=128,
    conv_kernel=4,
    hybrid_override_pattern="M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
)  # fmt: skip
GPT_OSS_20B = dict(num_hidden_layers=24, num_local_experts=32)  # GptOssConfig()'s are 120b's
SOURCES = {
    "qwen3-next-80b-a3b": "Qwen3NextConfig() defaults = Qwen/Qwen3-Next-80B-A3B-Instruct (48 "
    "layers: 36 gated DeltaNet, 12 gated attention of 2 KV heads x 256)",
    "qwen3.5": "Qwen3_5TextConfig() defaults (32 layers, 24 DeltaNet + 8 attention; its "
    "docstring names Qwen/Qwen3.5-27B, dimensions not checked against that checkpoint)",
    "gemma-3-4b": "google/gemma-3-4b-it's published text shape (34 layers, 5 sliding : 1 global, "
    "window 1024); Gemma3TextConfig() defaults are 26 x 2304 with window 4096, although its "
    "docstring names gemma-3-4b-it",
    "gpt-oss-20b": "openai/gpt-oss-20b (24 layers, 32 experts; sliding 128 and full alternating)",
    "gpt-oss-120b": "GptOssConfig() defaults: 36 layers and 128 experts = openai/gpt-oss-120b "
    "(its docstring names gpt-oss-20b)",
    "nemotron-nano-9b-v2": "nvidia/NVIDIA-Nemotron-Nano-9B-v2's published shape (56 layers: 27 "
    "Mamba2, 4 attention, 25 MLP); NemotronHConfig() defaults are a 4-layer placeholder with an "
    "MoE layer (refused by the runtime)",
}


@dataclass(frozen=True)
class Shape:
    name: str
    config_class: str  # transformers' config class
    architecture: str
    overrides: dict  # fields set over the class's defaults

    @property
    def source(self) -> str:
        """What the shape is, and where it comes from."""
        return SOURCES[self.name]


SHAPES = (
    Shape("qwen3-next-80b-a3b", "Qwen3NextConfig", "Qwen3NextForCausalLM", {}),
    Shape("qwen3.5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {}),
    Shape("gemma-3-4b", "Gemma3TextConfig", "Gemma3ForCausalLM", GEMMA_3_4B),
    Shape("gpt-oss-20b", "GptOssConfig", "GptOssForCausalLM", GPT_OSS_20B),
    Shape("gpt-oss-120b", "GptOssConfig", "GptOssForCausalLM", {}),
    Shape("nemotron-nano-9b-v2", "NemotronHConfig", "NemotronHForCausalLM", NEMOTRON_NANO_9B_V2),
)  # fmt: skip


def model_config(shape: Shape):
    """Our ModelConfig of ``shape`` (through the same ``from_dict`` a checkpoint goes through)."""
    import transformers

    from backends.runtime.config import ModelConfig

    raw = getattr(transformers, shape.config_class)(**shape.overrides).to_dict()
    raw["architectures"] = [shape.architecture]
    return ModelConfig.from_dict(raw)


def full_attention(cfg):
    """``cfg`` with every token-mixing layer full attention (MLP-only layers stay)."""
    from backends.runtime.config import RECURRENT_LAYER_TYPES

    mixers = ("full_attention", "sliding_attention", *RECURRENT_LAYER_TYPES)
    types = cfg.layer_types or ("full_attention",) * cfg.num_layers
    types = tuple("full_attention" if t in mixers else t for t in types)
    return replace(cfg, layer_types=types, deltanet=None, mamba=None)


def entry_layouts(cfg, kv_dtype: str, page_size: int = PAGE_SIZE) -> dict[str, EntryLayout]:
    """The stage's entries of ``cfg`` (one page or slot each: only their shapes count)."""
    from backends.runtime.runner import ModelRunner
    from backends.runtime.state_pool import StateSpec

    layouts_of = ModelRunner(cfg, None, kv_dtype, "cpu")  # its layouts only: no model, no pool
    out = {"target": layouts_of.entry_layout(1, page_size, "target")}
    if cfg.window_kv_layers:
        out["target.window"] = layouts_of.entry_layout(1, page_size, "target.window")
    spec = StateSpec.of(cfg)
    if spec is not None:
        out["target.state"] = spec.entry_layout(1)
    return out


def entry_bytes(lay: EntryLayout, tokens: int) -> int:
    """Bytes a room of ``tokens`` prompt tokens moves of entry ``lay`` (module docstring)."""
    _, count = lay.pages_for(tokens)
    return count * lay.num_layers * lay.components * lay.page_bytes


def family_rows(shape: Shape, lengths, kv_dtype: str) -> tuple[dict, list[dict]]:
    """(the shape's summary, one row per prompt length)."""
    from backends.runtime.state_pool import StateSpec

    cfg = model_config(shape)
    mine, full = entry_layouts(cfg, kv_dtype), entry_layouts(full_attention(cfg), kv_dtype)
    spec = StateSpec.of(cfg)
    kinds = cfg.layer_types or ("full_attention",) * cfg.num_layers
    summary = {
        "family": shape.name,
        "architecture": shape.architecture,
        "source": shape.source,
        "layers": cfg.num_layers,
        "layer_kinds": {k: kinds.count(k) for k in sorted(set(kinds))},
        "kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "kv_dtype": kv_dtype,
        "window": cfg.sliding_window if cfg.window_kv_layers else None,
        "entries": {role: lay.signature() for role, lay in mine.items()},
        "state_slot_bytes": spec.slot_bytes if spec else 0,
        "state_bytes_per_request": spec.bytes_per_sequence if spec else 0,
        # the layout a transfer moves vs the slot the runtime keeps: a mismatch is a bug
        "state_entry_matches_spec": spec is None
        or entry_bytes(mine["target.state"], 1) == spec.bytes_per_sequence,
    }
    rows = []
    for n in lengths:
        moved = {role: entry_bytes(lay, n) for role, lay in mine.items()}
        base = entry_bytes(full["target"], n)
        total = sum(moved.values())
        row = {
            "family": shape.name,
            "tokens": n,
            "bytes": total,
            "entry_bytes": moved,
            "bytes_per_token": total / n,
            "full_attention_bytes_per_token": base / n,
            "ratio_to_full_attention": total / base,
        }
        if "target.window" in mine:  # the sliding layers: the window's pages vs all of them
            win = mine["target.window"]
            every = -(-n // win.page_size) * win.num_layers * win.components * win.page_bytes
            row["window_bytes_saved"] = every - moved["target.window"]
            row["window_saved_fraction"] = 1 - moved["target.window"] / every
        rows.append(row)
    return summary, rows


def measure(lengths=DEFAULT_LENGTHS, kv_dtype: str = "bfloat16", names=None) -> dict:
    """Every shape (or those ``names``) at every prompt length."""
    shapes = [s for s in SHAPES if names is None or s.name in names]
    families, rows = [], []
    for shape in shapes:
        summary, r = family_rows(shape, lengths, kv_dtype)
        families.append(summary)
        rows += r
    return {"page_size": PAGE_SIZE, "lengths": list(lengths), "families": families, "rows": rows}
