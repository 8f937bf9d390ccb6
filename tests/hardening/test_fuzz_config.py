"""Fuzz the config parser: any JSON either parses to a ModelConfig or raises ConfigError, quickly."""

from __future__ import annotations

import copy
import json

from hypothesis import given
from hypothesis import strategies as st

from engine import config_to_hf, get_preset, parse_config
from engine.config_io import load_config
from engine.errors import ConfigError
from tests.hardening.conftest import bounded

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70)
                    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                    max_leaves=12)
BASES = [config_to_hf(get_preset("tiny", v)) for v in ("k3.1", "k3", "kimi-linear")]


def _paths(d, prefix=()):
    """Every (path) to a value in nested dicts, vision_config excluded (its parser is being rewritten)."""
    for k, v in d.items():
        if k == "vision_config":
            continue
        yield prefix + (k,)
        if isinstance(v, dict):
            yield from _paths(v, prefix + (k,))


def _parse(raw) -> None:
    with bounded():
        try:
            parse_config(raw)
        except ConfigError as exc:
            assert "\n" not in str(exc)


@given(base=st.sampled_from(range(len(BASES))), data=st.data())
def test_mutated_real_configs(base, data):
    raw = copy.deepcopy(BASES[base])
    paths = sorted(_paths(raw))
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        holder = raw
        for key in path[:-1]:
            holder = holder.get(key) if isinstance(holder, dict) else None
        if not isinstance(holder, dict):
            continue
        if data.draw(st.booleans()):
            holder[path[-1]] = data.draw(JSON)
        else:
            holder.pop(path[-1], None)
    _parse(raw)


@given(raw=st.dictionaries(st.sampled_from(["model_type", "text_config", "num_hidden_layers", "vocab_size",
                                            "linear_attn_config", "dsa_config", "quantization_config"]),
                           JSON, max_size=7))
def test_arbitrary_json_objects(raw):
    if raw.get("model_type") is None:
        raw["model_type"] = "kimi_linear"
    _parse(raw)


@given(blob=st.binary(max_size=200))
def test_arbitrary_config_bytes(tmp_path_factory, blob):
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_bytes(blob)
    with bounded():
        try:
            load_config(path)
        except ConfigError:
            pass


def test_the_bases_parse():
    for raw in BASES:
        parse_config(json.loads(json.dumps(raw)))
