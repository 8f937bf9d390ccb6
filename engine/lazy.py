"""Lazy public names of a package: `from engine import Session` imports the module that defines it
only when the name is first used, so light imports (`engine.errors`, a trace reader) never pull in torch."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def lazy_attributes(package: str, exports: Mapping[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: name -> the module defining it (`exports`); each value is
    cached in `namespace` (the package's globals) once loaded."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        namespace[name] = value
        return value

    return __getattr__
