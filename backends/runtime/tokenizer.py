"""Tokenizer of a checkpoint directory: encoding (optionally with the chat template), decoding.

Incremental detokenization of a stream, with stop strings: :mod:`backends.runtime.detok`.
"""

from __future__ import annotations

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
        return self.hf(text).input_ids

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat (``[{"role", "content"}, ...]``) rendered with the checkpoint's
        own chat template, ending with the assistant prompt."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this tokenizer has no chat template: send text_input instead")
        text = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.hf(text, add_special_tokens=False).input_ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)


def has_tokenizer(path: str) -> bool:
    """Whether the checkpoint directory ``path`` ships a tokenizer."""
    return any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
