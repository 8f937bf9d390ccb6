"""`K3Tokenizer`: the engine's tiktoken tokenizer as a transformers tokenizer.

Text is encoded by `engine.tokenizer.Tokenizer` itself (same ids as a `Session`); a token's string
form is its bytes read as Latin-1 (one character per byte), so any token, also half of a UTF-8
character, round-trips. Unlike the engine's `encode`, which never emits a control token, text
passed here is split at the special tokens' names (`<|open|>`, `[EOS]`, ...) the way every
transformers tokenizer treats its added tokens: this class is for libraries that render a chat
template to text and encode it (ContextCite, nnsight), not for untrusted documents.

`apply_chat_template` renders the K3 chat format (`Tokenizer.chat_prompt`), and a single text
encoded with `__call__` carries character offsets, so `BatchEncoding.token_to_chars` works as it
does for a fast tokenizer (ContextCite reads it).
"""

from __future__ import annotations

import os
from typing import Any

from transformers import AddedToken
from transformers.tokenization_python import PythonBackend
from transformers.tokenization_utils_base import BatchEncoding

from engine.config_io import load_config
from engine.errors import InputError
from engine.tokenizer import Tokenizer

# the K3 chat format as a Jinja template (what `Tokenizer.chat_prompt` builds in code)
K3_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|open|>message role=\"{{ message['role'] }}\"<|sep|>{{ message['content'] }}"
    "<|close|>message<|sep|><|end_of_msg|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>{%- endif -%}"
)


class _CharOffsets:
    """What `BatchEncoding.token_to_chars` / `char_to_token` ask of an encoding: token <-> char spans."""

    def __init__(self, spans: list[tuple[int, int]]) -> None:
        self.spans = spans

    def token_to_chars(self, token_index: int) -> tuple[int, int] | None:
        return self.spans[token_index] if 0 <= token_index < len(self.spans) else None

    def char_to_token(self, char_index: int, sequence_index: int = 0) -> int | None:
        for i, (start, end) in enumerate(self.spans):
            if start <= char_index < end:
                return i
        return None


class K3Tokenizer(PythonBackend):
    """Attributes:
        engine_tokenizer (Tokenizer): the engine's tokenizer doing the encoding.
    """

    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, engine_tokenizer: Tokenizer, eos_token: str | None = None, **kwargs: Any) -> None:
        if not isinstance(engine_tokenizer, Tokenizer):
            raise InputError(f"K3Tokenizer wraps an engine.tokenizer.Tokenizer, got {type(engine_tokenizer).__name__}")
        self.engine_tokenizer = engine_tokenizer
        self._by_bytes = {engine_tokenizer.token_bytes(i): i for i in range(engine_tokenizer.vocab_size)
                          if i not in engine_tokenizer.special_ids}
        special = {i: AddedToken(name, special=True, normalized=False) for name, i in engine_tokenizer.special.items()}
        names = engine_tokenizer.special
        if eos_token is None:
            eos_token = next((n for n in ("<|end_of_msg|>", "[EOS]") if n in names), None)
        kwargs.setdefault("bos_token", "[BOS]" if "[BOS]" in names else None)
        kwargs.setdefault("chat_template", K3_CHAT_TEMPLATE)
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        super().__init__(added_tokens_decoder=special, eos_token=eos_token, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike[str], *args: Any,
                        **kwargs: Any) -> "K3Tokenizer":
        """The tokenizer of a local checkpoint directory or `builtin:NAME` (its eos is the model's)."""
        from engine.hf.model import resolve_directory  # the one place that resolves a checkpoint name

        directory = resolve_directory(pretrained_model_name_or_path)
        config = load_config(directory)
        engine_tokenizer = Tokenizer.for_model(directory, config.vocab_size)
        if engine_tokenizer is None:
            raise InputError(f"{directory}: this checkpoint ships no tokenizer files (tiktoken.model)")
        eos = config.special_token_id("eos_token_id")
        kwargs.setdefault("eos_token", engine_tokenizer.piece(eos) if eos is not None else None)
        return cls(engine_tokenizer, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.engine_tokenizer.vocab_size

    def get_vocab(self) -> dict[str, int]:
        vocab = {token.decode("latin-1"): i for token, i in self._by_bytes.items()}
        vocab.update(self.engine_tokenizer.special)
        return vocab

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        return [self.engine_tokenizer.token_bytes(i).decode("latin-1") for i in self.engine_tokenizer.encode(text)]

    def _convert_token_to_id(self, token: str) -> int:
        found = self._by_bytes.get(token.encode("latin-1", errors="replace"))
        if found is None:
            raise InputError(f"{token!r:.40} is not a token of this vocabulary")
        return found

    def _convert_id_to_token(self, index: int) -> str:
        if index in self.engine_tokenizer.special_ids:
            return self.engine_tokenizer.piece(index)
        return self.engine_tokenizer.token_bytes(index).decode("latin-1")

    def _token_bytes(self, token: str) -> bytes:
        if token in self._added_tokens_encoder:
            return token.encode("utf-8")
        return token.encode("latin-1", errors="replace")

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return b"".join(self._token_bytes(t) for t in tokens).decode("utf-8", errors="replace")

    def _encode_plus(self, text: Any, text_pair: Any = None, **kwargs: Any) -> BatchEncoding:
        """As transformers encodes; a single text also gets its tokens' character spans."""
        encoded = super()._encode_plus(text, text_pair, **kwargs)
        if isinstance(text, str) and text_pair is None and kwargs.get("return_tensors") is None \
                and not kwargs.get("add_special_tokens", True) and "input_ids" in encoded:
            spans = _char_spans(text, [self._token_bytes(self._convert_id_to_token(i)) for i in encoded["input_ids"]])
            if spans is not None:
                encoded._encodings = [_CharOffsets(spans)]
        return encoded

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        raise InputError("K3Tokenizer is read from a checkpoint's tiktoken files; copy those files instead")


def _char_spans(text: str, pieces: list[bytes]) -> list[tuple[int, int]] | None:
    """Each piece's [start, end) in characters of `text` (a piece inside one character spans it);
    None when the pieces do not spell `text` (nothing to point into)."""
    data = text.encode("utf-8")
    if b"".join(pieces) != data:
        return None
    char_of_byte = []
    for i, ch in enumerate(text):
        char_of_byte.extend([i] * len(ch.encode("utf-8")))
    spans, at = [], 0
    for piece in pieces:
        end = at + len(piece)
        if not piece:
            spans.append((char_of_byte[at] if at < len(data) else len(text),) * 2)
            continue
        spans.append((char_of_byte[at], char_of_byte[end - 1] + 1))
        at = end
    return spans
