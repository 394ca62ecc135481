"""Tokenizer of a checkpoint directory, chat-template encoding and incremental detokenization."""

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

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self)


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas without splitting multi-byte characters.

    Decodes a short window ending at the newest token and emits the part that is new since the
    previous call; text ending in U+FFFD (an incomplete UTF-8 sequence) is held back.
    """

    def __init__(self, tokenizer: Tokenizer, context: int = 6):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start
        self.read_offset = 0  # ids up to here have been emitted
        self.context = context
        self.text = ""

    def add(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) < len(prefix):
            return ""
        delta = full[len(prefix) :]
        self.read_offset = len(self.ids)
        self.prefix_offset = max(0, self.read_offset - self.context)
        self.text += delta
        return delta
