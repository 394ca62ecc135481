"""Tokenizer of a checkpoint directory: encoding (optionally with the chat template), decoding.

Incremental detokenization of a stream, with stop strings: :mod:`backends.runtime.detok`.
"""

from __future__ import annotations

import functools
import json
import os


class Tokenizer:
    def __init__(self, path: str):
        from transformers import AutoTokenizer

        if not has_tokenizer(path):
            raise FileNotFoundError(
                f"no tokenizer in model directory {path!r}: expected tokenizer.json"
            )
        self.hf = AutoTokenizer.from_pretrained(path)
        self.eos_token_id = self.hf.eos_token_id

    def encode(self, text: str, chat: bool = False) -> list[int]:
        """Token ids of ``text``; ``chat=True`` wraps it as one user turn of the chat template
        and appends the assistant prompt."""
        if chat:
            return self.encode_chat([{"role": "user", "content": text}])
        return self.encode_text(text)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat (``[{"role", "content"}, ...]``) rendered with the checkpoint's
        own chat template, ending with the assistant prompt."""
        return self.encode_text(self.render_chat(messages), special=False)

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The text of a chat in the checkpoint's chat template, ending with the assistant
        prompt (its ids: ``encode_text(text, special=False)``)."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this tokenizer has no chat template: send text_input instead")
        return self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def encode_text(self, text: str, special: bool = True) -> list[int]:
        """Token ids of ``text`` as is (``special``: with the tokenizer's BOS and the like)."""
        return self.hf(text, add_special_tokens=special).input_ids

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """The most bytes of a text one token can stand for, when that is bounded: then a text
        of B UTF-8 bytes encodes to at least ceil(B / max_token_bytes) tokens, a bound that
        needs no tokenization. Bounded for byte-level BPE without a normalizer (GPT-2, Llama 3,
        Qwen, SmolLM2): every token stands for a run of the text's bytes, as many as its
        string has characters (one per byte), an added token for its content. None otherwise:
        a normalizer can shrink a text, and an added token that strips the spaces beside it
        stands for any number of them."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None:
            return None
        spec = json.loads(backend.to_str())
        pre = spec.get("pre_tokenizer") or {}
        pres = pre.get("pretokenizers") or [pre]
        byte_level = any(p and p.get("type") == "ByteLevel" for p in pres)
        model = spec.get("model") or {}
        if spec.get("normalizer") or model.get("type") != "BPE" or not byte_level:
            return None
        added = spec.get("added_tokens") or []
        if any(a.get("lstrip") or a.get("rstrip") for a in added):
            return None
        longest = max((len(t) for t in model.get("vocab", {})), default=0)
        return max([longest, *(len(a["content"].encode()) for a in added)]) or None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)


def has_tokenizer(path: str) -> bool:
    """Whether the checkpoint directory ``path`` ships a tokenizer."""
    return any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
