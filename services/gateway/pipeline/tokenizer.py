"""The model's tokenizer (a `tokenizers.Tokenizer` from tokenizer.json) and incremental
detokenization of generated tokens, both pure: no I/O after loading.

Incremental detokenization follows TGI's `decode_token`: the text of a new token is the
difference between decoding a window `[prefix_offset:]` and `[prefix_offset:read_offset]`,
so tokenizers whose decoders strip or add leading spaces (SentencePiece `▁`) and byte-level
pieces that form one character together come out right. Text is held back while it ends
in U+FFFD (an incomplete UTF-8 sequence) and flushed at the end.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT = 5  # prompt tokens kept as decoding context for the first generated tokens


class TokenizerError(ValueError):
    """The tokenizer failed on an input."""


@dataclass(frozen=True)
class TokenSpan:
    """One prompt token for /tokenize: byte offsets into the input string."""

    id: int
    text: str
    start: int
    stop: int


class TextTokenizer:
    """Encode prompts, decode tokens, and know which ids are special."""

    def __init__(self, tokenizer: Tokenizer, config: dict | None = None):
        self.tokenizer = tokenizer
        self.config = config or {}
        added = tokenizer.get_added_tokens_decoder()
        self.special_ids: set[int] = {i for i, tok in added.items() if tok.special}
        self.special_text: dict[int, str] = {i: added[i].content for i in self.special_ids}

    @classmethod
    def from_folder(cls, folder: Path) -> TextTokenizer:
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json")
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        return cls(Tokenizer.from_file(str(file)), config)

    def encode(
        self, text: str, truncate: int | None = None, add_special_tokens: bool = True
    ) -> list[int]:
        """Prompt ids, special tokens (BOS) added unless the text has them already (chat
        templates); `truncate` keeps the last N."""
        try:
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        except Exception as exc:  # the Rust side raises plain Exceptions
            raise TokenizerError(str(exc)) from exc
        if truncate is not None and truncate < len(ids):
            ids = ids[-truncate:]
        return ids

    def spans(
        self, text: str, truncate: int | None = None, add_special_tokens: bool = True
    ) -> list[TokenSpan]:
        """Tokens of `text` with byte offsets (TGI /tokenize)."""
        try:
            encoding = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except Exception as exc:
            raise TokenizerError(str(exc)) from exc
        byte_at = [0]
        for char in text:
            byte_at.append(byte_at[-1] + len(char.encode("utf-8")))
        out = []
        for token_id, (start, stop) in zip(encoding.ids, encoding.offsets):
            if token_id in self.special_ids and start == stop:
                piece = self.special_text[token_id]
            else:
                piece = text[start:stop]
            out.append(TokenSpan(token_id, piece, byte_at[start], byte_at[stop]))
        if truncate is not None and truncate < len(out):
            out = out[-truncate:]
        return out

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        """Token ids run from 0 to vocab_size - 1 (added tokens included)."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    def token_text(self, token_id: int) -> str:
        """Standalone text of one token (for top_tokens)."""
        if token_id in self.special_ids:
            return self.special_text[token_id]
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


class IncrementalDetokenizer:
    """Text of each generated token, such that the texts concatenate to the decoded output.

    Special tokens yield their content and stay out of the decoded text (so they never appear
    in generated_text). `add` returns "" while a character is incomplete; `flush` returns what
    is still held when the generation ends.
    """

    def __init__(self, tokenizer: TextTokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        context = [i for i in prompt_ids[-PROMPT_CONTEXT:] if i not in tokenizer.special_ids]
        self.ids: list[int] = context  # decoding window: prompt context + generated ids
        self.prefix_offset = 0
        self.read_offset = len(context)

    def add(self, token_id: int) -> str:
        if self.tokenizer.is_special(token_id):
            return self.tokenizer.special_text[token_id]
        self.ids.append(token_id)
        text, is_complete = self._new_text(self.ids[self.prefix_offset :])
        if not is_complete:
            return ""  # shown with the token that completes the character
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text

    def peek(self, token_id: int) -> str:
        """The text `token_id` would add here, without adding it: an alternative token's text
        (top tokens), decoded in the same context as the token chosen there, so one id has
        one text, its leading space included. A token that leaves a character incomplete
        shows the decoder's U+FFFD (no later token will complete an alternative)."""
        if self.tokenizer.is_special(token_id):
            return self.tokenizer.special_text[token_id]
        return self._new_text([*self.ids[self.prefix_offset :], token_id])[0]

    def _new_text(self, window: list[int]) -> tuple[str, bool]:
        """(the text the last id of `window` adds, whether it ends on a whole character)."""
        prefix_text = self.tokenizer.decode(window[: self.read_offset - self.prefix_offset])
        new_text = self.tokenizer.decode(window)
        is_complete = len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT)
        return new_text[len(prefix_text) :], is_complete

    def flush(self) -> str:
        """Text of tokens still held (an incomplete character at the very end)."""
        if self.read_offset >= len(self.ids):
            return ""
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text.removeprefix(prefix_text)
