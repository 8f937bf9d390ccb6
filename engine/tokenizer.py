"""Tokenizer: the Kimi tiktoken files, offline, and the chat format (spec section 9).

Files (the real layout): `tiktoken.model` (one `base64(token) rank` line per base token) and
`tokenizer_config.json` whose `added_tokens_decoder` names the special ids that follow the base
vocabulary ([BOS], [EOS], <|end_of_msg|>, <|open|>, <|close|>, <|sep|>, media tokens, reserved).

User text is always encoded with no special tokens allowed: a document containing `<|open|>` is
tokenized as the characters `<`, `|`, `open`, ..., never as the control token, so it cannot inject
chat structure. Only `chat_prompt` (built here in code, no templates) emits control tokens.

`write_byte_level_tokenizer` writes the small byte-level tokenizer our random checkpoints ship
(256 single-byte ranks + 256 specials) in the same file format.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import tiktoken

from engine.builtin import model_dir
from engine.errors import CheckpointError, InputError
from engine.io.files import read_limited

# Kimi's pre-tokenization split (Han runs, cased words with contractions, 1-3 digit groups, ...)
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

NUM_SPECIAL = 256
_MAX_MODEL_BYTES = 256 << 20  # the real tiktoken.model (163,584 ranks) is about 2.5 MB
_MAX_CONFIG_BYTES = 16 << 20
# offset from the first special id -> name (the real Kimi ids are 163584 + offset)
SPECIAL_NAMES = {0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>",
                 18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>"}


@dataclass(frozen=True)
class Message:
    role: str  # "system" | "user" | "assistant" | "tool"
    content: str


class Tokenizer:
    """tiktoken encoding + named special ids + the chat format."""

    def __init__(self, encoding: tiktoken.Encoding, special: dict[str, int]) -> None:
        self.encoding = encoding
        self.special = special
        self.special_ids = set(special.values())
        self.vocab_size = encoding.n_vocab
        self.bos_id = special.get("[BOS]")
        self.end_of_msg_id = special.get("<|end_of_msg|>")
        self.open_id, self.close_id, self.sep_id = (special.get(n) for n in ("<|open|>", "<|close|>", "<|sep|>"))
        # ids no trained model emits (placeholders in the special range): sessions never sample them
        self.reserved_ids = frozenset(i for n, i in special.items() if n.startswith("<|reserved_token_"))

    @classmethod
    def load(cls, directory: str | Path) -> "Tokenizer":
        """Read `tiktoken.model` + `tokenizer_config.json` from `directory` (no network)."""
        d = Path(directory)
        model_file, config_file = d / "tiktoken.model", d / "tokenizer_config.json"
        if not model_file.exists():
            raise CheckpointError(f"{model_file}: tokenizer file is missing")
        ranks = _read_ranks(model_file)
        special: dict[str, int] = {}
        if config_file.exists():
            special = _read_special(config_file, len(ranks))
        base, named = len(ranks), set(special.values())
        for offset in range(NUM_SPECIAL):  # unnamed special ids still decode
            if base + offset not in named:
                special[f"<|reserved_token_{offset}|>"] = base + offset
        below = sorted(i for i in special.values() if i < base)
        if below:
            raise CheckpointError(f"{config_file}: special token ids {below[:5]} collide with base ranks (< {base})")
        encoding = tiktoken.Encoding(name=d.name or "kimi", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                                     special_tokens=special)
        return cls(encoding, special)

    @classmethod
    def byte_level(cls) -> "Tokenizer":
        """The byte-level tokenizer of our random checkpoints, built in memory (same as the files)."""
        ranks = {bytes([b]): b for b in range(256)}
        special = {SPECIAL_NAMES.get(o, f"<|reserved_token_{o}|>"): 256 + o for o in range(NUM_SPECIAL)}
        return cls(tiktoken.Encoding(name="byte-level", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                                     special_tokens=special), special)

    @classmethod
    def for_model(cls, path: str | Path, vocab_size: int) -> "Tokenizer | None":
        """The tokenizer that goes with a model: its directory's files, or byte-level for a preset
        whose vocabulary is 256 bytes + 256 specials; None when there is none. `builtin:NAME` means
        its shipped directory."""
        d = Path(model_dir(path))
        if d.is_dir() and (d / "tiktoken.model").exists():
            return cls.load(d)
        if d.is_dir() and (d / "tokenizer_config.json").exists():
            # the checkpoint ships a tokenizer whose vocabulary file is gone: falling back to bytes
            # would silently produce different ids (and different text) than the model was trained on
            raise CheckpointError(f"{d / 'tiktoken.model'}: tokenizer file is missing although "
                                  f"{d / 'tokenizer_config.json'} is present; restore it (or remove both to "
                                  f"run without a tokenizer)")
        if vocab_size == 256 + NUM_SPECIAL:
            return cls.byte_level()
        return None

    def encode(self, text: str) -> list[int]:
        """Plain text -> ids; special-token text is encoded literally (no injection)."""
        return self.encoding.encode(text, allowed_special=set(), disallowed_special=())

    def decode(self, ids: Iterable[int]) -> str:
        return self.encoding.decode(list(ids), errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token (b"" for an id past this tokenizer's vocabulary: a model may be larger)."""
        try:
            return self.encoding.decode_single_token_bytes(token_id)
        except KeyError:
            return b""

    def piece(self, token_id: int) -> str:
        """Display text of one token (special names verbatim, partial UTF-8 as replacement chars)."""
        return self.encoding.decode_single_token_bytes(token_id).decode("utf-8", errors="replace")

    def _tag(self, ids: list[int], opening: bool, name: str) -> None:
        ids.append(self.open_id if opening else self.close_id)
        ids.extend(self.encode(name))
        ids.append(self.sep_id)

    def section_tag(self, name: str, opening: bool) -> list[int]:
        """Ids of one chat-structure tag: `<|open|>{name}<|sep|>` or `<|close|>{name}<|sep|>`
        (`message role="user"`, `think`, `response`, ...)."""
        if None in (self.open_id, self.close_id, self.sep_id):
            raise InputError("this tokenizer has no chat control tokens (<|open|>, <|close|>, <|sep|>)")
        ids: list[int] = []
        self._tag(ids, opening, name)
        return ids

    def message_frame(self, role: str) -> tuple[list[int], list[int]]:
        """(opening, closing) ids of one chat message: `<|open|>message role="R"<|sep|>` and
        `<|close|>message<|sep|><|end_of_msg|>`; a message's body (text, image spans) goes between."""
        if None in (self.open_id, self.close_id, self.sep_id, self.end_of_msg_id):
            raise InputError("this tokenizer has no chat control tokens (<|open|>, <|close|>, <|sep|>, <|end_of_msg|>)")
        if role not in ("system", "user", "assistant", "tool"):
            raise InputError(f"unknown chat role {role!r}")
        opening: list[int] = []
        closing: list[int] = []
        self._tag(opening, True, f'message role="{role}"')
        self._tag(closing, False, "message")
        closing.append(self.end_of_msg_id)  # type: ignore[arg-type]
        return opening, closing

    def message_ids(self, role: str, body: Sequence[int]) -> list[int]:
        """One chat message around already-built `body` ids (text, or an image's media tokens)."""
        opening, closing = self.message_frame(role)
        return opening + list(body) + closing

    def response_prefix(self, text: str = "") -> list[int]:
        """After the generation prompt: close the (empty) `think` section, open `response` and start it
        with `text` (a prefilled answer start, e.g. the key the demo model restates)."""
        ids: list[int] = []
        self._tag(ids, False, "think")
        self._tag(ids, True, "response")
        return ids + self.encode(text)

    def chat_prompt(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation in the K3 chat format, built in code.

        Each message: `<|open|>message role="R"<|sep|>{text}<|close|>message<|sep|><|end_of_msg|>`;
        the generation prompt opens an assistant message and its `think` section.
        """
        if None in (self.open_id, self.close_id, self.sep_id, self.end_of_msg_id):
            raise InputError("this tokenizer has no chat control tokens (<|open|>, <|close|>, <|sep|>, <|end_of_msg|>)")
        ids: list[int] = []
        for m in messages:
            ids.extend(self.message_ids(m.role, self.encode(m.content)))
        if add_generation_prompt:
            self._tag(ids, True, 'message role="assistant"')
            self._tag(ids, True, "think")
        return ids


def _read_ranks(model_file: Path) -> dict[bytes, int]:
    """`base64(token) rank` lines -> ranks, checked so that tiktoken can never panic on them."""
    data = read_limited(model_file, "a tiktoken.model", CheckpointError, _MAX_MODEL_BYTES)
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{model_file}: not a tiktoken.model text file (byte {exc.start} is not ASCII)") from None
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            piece = base64.b64decode(token, validate=True)
            if not rank.isdigit():
                raise ValueError(rank)
        except ValueError:
            raise CheckpointError(f"{model_file}:{lineno}: expected `base64-token rank`") from None
        if not piece:
            raise CheckpointError(f"{model_file}:{lineno}: empty token")
        if piece in ranks:
            raise CheckpointError(f"{model_file}:{lineno}: token {piece!r:.40} is listed twice")
        ranks[piece] = int(rank)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise CheckpointError(f"{model_file}: ranks must be 0..{len(ranks) - 1} without gaps")
    # byte-pair encoding falls back to single bytes: without a rank for every byte, encoding some
    # text makes the tokenizer library panic instead of raising
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise CheckpointError(f"{model_file}: {len(missing)} single byte(s) have no rank (e.g. 0x{missing[0]:02x}); "
                              "every byte 0x00-0xff needs one")
    return ranks


def _read_special(config_file: Path, base: int) -> dict[str, int]:
    """`added_tokens_decoder` of tokenizer_config.json -> {content: id}, ids checked."""
    data = read_limited(config_file, "a tokenizer_config.json", CheckpointError, _MAX_CONFIG_BYTES)
    try:
        config = json.loads(data.decode("utf-8"))
        decoder = config.get("added_tokens_decoder", {}) if isinstance(config, dict) else None
        if not isinstance(decoder, dict):
            raise TypeError("added_tokens_decoder must be an object {id: {content: ...}}")
        if len(decoder) > NUM_SPECIAL:  # counted before anything is built from them
            raise TypeError(f"it lists {len(decoder):,} special tokens, more than the {NUM_SPECIAL} ids that "
                            "follow the base vocabulary")
        special = {}
        for k, v in decoder.items():
            if not isinstance(v, dict) or not isinstance(v.get("content"), str) or not (k.isascii() and k.isdigit()):
                raise TypeError(f"entry {k!r:.40} needs a decimal id and a string content")
            special[v["content"]] = int(k)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{config_file}: cannot read added_tokens_decoder ({str(exc)[:200]})") from None
    # the specials are the NUM_SPECIAL ids right after the base ranks (the vocabulary ends there); ids
    # below collide with ranks, which `load` reports with the ranks they collide with
    beyond = sorted(i for i in special.values() if i >= base + NUM_SPECIAL)
    if beyond:
        raise CheckpointError(f"{config_file}: special token ids {beyond[:3]} are beyond the vocabulary (the "
                              f"{NUM_SPECIAL} special ids are {base}..{base + NUM_SPECIAL - 1})")
    if len(set(special.values())) != len(special):
        raise CheckpointError(f"{config_file}: two special tokens share an id")
    return special


def write_byte_level_tokenizer(directory: str | Path, *, base_vocab: int = 256) -> None:
    """Write a byte-level tokenizer (ranks 0..255 = single bytes) in the Kimi file format."""
    if base_vocab != 256:
        raise ValueError("the byte-level tokenizer has exactly 256 base tokens")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]
    (d / "tiktoken.model").write_text("\n".join(lines) + "\n")
    decoder = {}
    for offset in range(NUM_SPECIAL):
        name = SPECIAL_NAMES.get(offset, f"<|reserved_token_{offset}|>")
        decoder[str(base_vocab + offset)] = {"content": name, "lstrip": False, "normalized": False,
                                             "rstrip": False, "single_word": False, "special": True}
    config = {
        "added_tokens_decoder": decoder,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[EOS]",
        "model_max_length": 1048576,
        "tokenizer_class": "TikTokenTokenizer",
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")


def parse_answer(text: str) -> str | None:
    """The response text of a generated assistant turn in the K3 format (what follows
    `<|open|>response<|sep|>` up to the next `<|close|>`); None when the turn has no response section."""
    head = "<|open|>response<|sep|>"
    at = text.find(head)
    if at < 0:
        return None
    rest = text[at + len(head):]
    end = rest.find("<|close|>")
    return rest if end < 0 else rest[:end]
