"""Building a model on the meta device without running its initialisers.

A model is built on the meta device (shapes only) and then filled from a checkpoint, so the random
initialisers `nn.Linear` and `nn.Embedding` call in their constructors have nothing to do. On meta
tensors they still run, and `normal_` on a meta tensor goes through torch's Python reference
implementation, which imports `torch._dynamo` (and with it inductor and sympy) on first use: a
large share of the resident memory of a process that may never compile anything (figures in
docs/benchmarks.md, 'The CPU engine against llama.cpp'). `on_meta()` skips those calls; the
compiled decode step imports the compiler when it is first asked for.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

# in-place random fills a constructor may call directly instead of through torch.nn.init
_TENSOR_INITS = frozenset({torch.Tensor.normal_, torch.Tensor.uniform_})


def _is_initialiser(func: Any) -> bool:
    return func in _TENSOR_INITS or getattr(func, "__module__", None) == "torch.nn.init"


class _SkipMetaInit(TorchFunctionMode):
    """Returns the tensor unchanged for an initialiser called on a meta tensor (it holds no values)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        first = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes it by keyword
        if isinstance(first, torch.Tensor) and first.is_meta and _is_initialiser(func):
            return first
        return func(*args, **kwargs)


@contextmanager
def on_meta() -> Iterator[None]:
    """`torch.device("meta")` for building a model whose values come later (`to_empty` + a fill):
    modules built inside hold meta tensors, and their random initialisers are skipped."""
    with torch.device("meta"), _SkipMetaInit():
        yield
