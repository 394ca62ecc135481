"""Tokenizer of a checkpoint directory: encoding (optionally with the chat template), decoding.

Incremental detokenization of a stream is stateless and lives with the stages
(:func:`backends.stages.text.text_delta`).
"""

from __future__ import annotations

import os


class Tokenizer:
    def __init__(self, path: str):
        from transformers import AutoTokenizer

        if not os.path.isfile(os.path.join(path, "tokenizer.json")) and not os.path.isfile(
            os.path.join(path, "tokenizer_config.json")
        ):
            raise FileNotFoundError(
                f"no tokenizer in model directory {path!r}: expected tokenizer.json"
            )
        self.hf = AutoTokenizer.from_pretrained(path)
        self.eos_token_id = self.hf.eos_token_id

    def encode(self, text: str, chat: bool = False) -> list[int]:
        """Token ids of ``text``; ``chat=True`` wraps it as one user turn of the chat template
        and appends the assistant prompt."""
        if chat:
            if not getattr(self.hf, "chat_template", None):
                raise ValueError("this tokenizer has no chat template; encode with chat=False")
            messages = [{"role": "user", "content": text}]
            text = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return self.hf(text, add_special_tokens=False).input_ids
        return self.hf(text).input_ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)
