"""Fuzz the tokenizer files: any tiktoken.model / tokenizer_config.json either loads into a tokenizer that
encodes and decodes any text (no panic from the tokenizer library) or raises CheckpointError."""

from __future__ import annotations

import base64
import json

from hypothesis import given
from hypothesis import strategies as st

from engine.errors import CheckpointError
from engine.tokenizer import Tokenizer, write_byte_level_tokenizer
from tests.hardening.conftest import bounded

TOKENS = st.binary(min_size=0, max_size=3)
LINE = st.one_of(
    st.tuples(TOKENS, st.integers(-2, 300)).map(lambda t: f"{base64.b64encode(t[0]).decode()} {t[1]}"),
    st.text(max_size=10),
)


def _load_and_use(d, text: str) -> None:
    with bounded():
        try:
            tok = Tokenizer.load(d)
        except CheckpointError as exc:
            assert "\n" not in str(exc)
            return
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        for i in ids[:20]:
            tok.piece(i)


@given(drop=st.lists(st.integers(0, 255), max_size=3), extra=st.lists(LINE, max_size=4),
       shuffle=st.randoms(use_true_random=False), text=st.text(max_size=40))
def test_edited_byte_level_models(tmp_path_factory, drop, extra, shuffle, text):
    d = tmp_path_factory.mktemp("tok")
    write_byte_level_tokenizer(d)
    lines = [line for line in (d / "tiktoken.model").read_text().splitlines()
             if base64.b64decode(line.split()[0])[0] not in drop]
    lines += extra
    shuffle.shuffle(lines)
    (d / "tiktoken.model").write_text("\n".join(lines) + "\n")
    _load_and_use(d, text)


@given(blob=st.binary(max_size=200), text=st.text(max_size=10))
def test_arbitrary_model_bytes(tmp_path_factory, blob, text):
    d = tmp_path_factory.mktemp("tok")
    write_byte_level_tokenizer(d)
    (d / "tiktoken.model").write_bytes(blob)
    _load_and_use(d, text)


DECODER = st.dictionaries(st.text(max_size=12), st.fixed_dictionaries({"content": st.text(max_size=6)})
                          | st.integers() | st.none(), max_size=5)


@given(config=st.fixed_dictionaries({"added_tokens_decoder": DECODER | st.lists(st.integers(), max_size=2)})
       | st.lists(st.integers(), max_size=2) | st.text(max_size=5), text=st.text(max_size=20))
def test_tokenizer_configs(tmp_path_factory, config, text):
    d = tmp_path_factory.mktemp("tok")
    write_byte_level_tokenizer(d)
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    _load_and_use(d, text)
