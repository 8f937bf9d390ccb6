"""Run configurations as data: one TOML file per job (`training/configs/*.toml`), read with tomllib into
an entry point's argparse defaults, so `--config FILE` gives every setting of a shipped run and any flag
on the command line still overrides it.

A file is a flat table whose keys are the entry point's option names with underscores
(`varied_share = 0.7`, `gaps = true`) and whose `kind` names the entry point it is for (`demo_model`,
`lengthen`, `extend`, `gpu_run`). Paths (`--state`, `--out`, `--base`) are usually left to the command
line: they are the machine's, not the run's. Anything the entry point would not accept (an unknown key,
a value of the wrong type or outside its choices, a file of another kind) exits with one line naming
the file and the key.
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent / "configs"
MAX_CONFIG_BYTES = 1 << 20   # a run configuration is a few lines; anything larger is not one


def add_config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=None,
                        help=f"a run configuration (TOML, e.g. {CONFIGS.relative_to(CONFIGS.parent.parent)}/*.toml): "
                             "its values are the defaults, flags override them")


def read(path: Path, kind: str) -> dict:
    """The settings of run configuration `path` for entry point `kind` (without `kind`); one-line exit otherwise."""
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise SystemExit(f"{path}: {size:,} bytes is not a run configuration (at most {MAX_CONFIG_BYTES:,})")
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SystemExit(f"--config {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise SystemExit(f"{path}: not valid TOML ({exc})") from None
    if data.get("kind") != kind:
        raise SystemExit(f"{path}: kind = {data.get('kind')!r}, but this is training.{kind} (kind = {kind!r})")
    return {k: v for k, v in data.items() if k != "kind"}


def _coerce(path: Path, key: str, value, action: argparse.Action):
    """`value` as the option `action` would have parsed it, or a one-line exit naming the key."""
    def bad(what: str) -> SystemExit:
        return SystemExit(f"{path}: {key} = {value!r}: {what}")

    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise bad("must be true or false")
        return value
    kind = action.type or str
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    elif kind is Path:
        if not isinstance(value, str):
            raise bad("must be a path (a string)")
        value = Path(value)
    elif kind in (int, float, str) and not (isinstance(value, kind) and not isinstance(value, bool)):
        raise bad(f"must be {'a number' if kind is float else 'an integer' if kind is int else 'a string'}")
    elif kind not in (int, float, str, Path):
        raise bad("cannot be set in a run configuration")
    if action.choices is not None and value not in action.choices:
        raise bad(f"must be one of {sorted(action.choices)}")
    return value


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None, kind: str) -> argparse.Namespace:
    """`parser`'s arguments, with the defaults of the run configuration `--config` names when there is one."""
    add_config_option(parser)
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--config", type=Path, default=None)
    known, _ = early.parse_known_args(argv)
    if known.config is not None:
        actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
        values = {}
        for key, value in read(known.config, kind).items():
            if key not in actions:
                raise SystemExit(f"{known.config}: unknown setting {key!r} for training.{kind} "
                                 f"(settings are its options with underscores, e.g. {sorted(actions)[:3]})")
            values[key] = _coerce(known.config, key, value, actions[key])
            actions[key].required = False   # given by the file
        parser.set_defaults(**values)
    return parser.parse_args(argv)


def recorded(args: argparse.Namespace) -> dict:
    """The run configuration's record in the run's state and training.json ({} without one)."""
    return {"config_file": str(args.config)} if getattr(args, "config", None) is not None else {}
