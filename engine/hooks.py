"""Named hook points: identity modules at the places researchers name (docs/hooks.md has the table).

A `HookPoint` is an `nn.Module` that returns its input. The layers pass a tensor through one only
when a hook is attached to it (`through`): with nothing attached the point is never called, so the
prefill and the compiled decode step run exactly the code they ran before the points existed
(the decode step falls back to the eager forward while any point has a hook: `any_attached`).

Hooks are plain PyTorch forward hooks: `model.get_submodule(path).register_forward_hook(fn)` with
`fn(module, args, output)`; returning a tensor replaces the output (an edit). During the call the
point's `start` is the position of the first row of the tensor (per-token points, `[B, T, ...]`) or
the position after which a state is shown (`blocks.{i}.kda.hook_state`). `hooks(model, [(name, fn)])`
attaches hooks by their names and removes them when its block ends, whatever happens in it.

How hook points relate to probes (`engine.probes`): a probe is declared, typed and bounded, always
on while a recorder listens, and its rows go to a trace at 1M tokens; a hook point is ad hoc, for a
question asked once in a notebook, and costs nothing until something is attached.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from engine.errors import InputError

HookFn = Callable[[nn.Module, tuple, Any], Any]

# hooks attached to any HookPoint in this process through `register_forward_hook` / `register_forward_pre_hook`
# (minus those removed by their handles): 0 lets the decode step skip looking at its points (one integer
# check instead of a scan of every point); above 0 it looks at each point, so a stale count is only slower, never wrong
_LIVE = [0]


def _counted(handle: RemovableHandle) -> RemovableHandle:
    _LIVE[0] += 1
    remove = handle.remove
    done = [False]

    def remove_once() -> None:
        if not done[0]:
            done[0] = True
            _LIVE[0] -= 1
        remove()

    handle.remove = remove_once  # type: ignore[method-assign]  # `with handle:` calls it too
    return handle


class HookPoint(nn.Module):
    """An identity module named `name` (TransformerLens style, e.g. `blocks.3.hook_resid_post`).

    Attributes:
        name: the point's name in docs/hooks.md's table.
        start: position of the tensor's first row (or of a state) during the current call; an int, or a
            0-d device tensor inside the eager decode step.
        positions: for state points only: the positions after which the state is shown (None: after the
            last position of each forward call). Setting it makes the layer split its recurrence there.
    """

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.start: int | torch.Tensor = 0
        self.positions: frozenset[int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def extra_repr(self) -> str:
        return self.name

    def register_forward_hook(self, hook: Callable, *args: Any, **kwargs: Any) -> RemovableHandle:
        return _counted(super().register_forward_hook(hook, *args, **kwargs))

    def register_forward_pre_hook(self, hook: Callable, *args: Any, **kwargs: Any) -> RemovableHandle:
        return _counted(super().register_forward_pre_hook(hook, *args, **kwargs))

    @property
    def attached(self) -> bool:
        """Whether any hook would see this point's tensor (a layer calls the point only then)."""
        return bool(self._forward_hooks or self._forward_pre_hooks)


def bind_points(root: nn.Module) -> None:
    """Make each hook point under `root` a plain attribute of its owner as well as a registered submodule.

    A layer reads its points as `self.hook_*` on every call, attached or not; through
    `nn.Module.__getattr__` (the fallback after a failed lookup), ~150 times per eager demo decode step
    (a percent or two of it). In the owner's `__dict__` the read is a dict hit. Dynamo
    resolves the attribute to the same object either way (its lookup tries `__dict__` before
    `_modules`), so the compiled step's graph is unchanged. Assigning a new module to the attribute
    replaces both entries (`nn.Module.__setattr__` drops the `__dict__` one); the points are never
    reassigned otherwise."""
    for owner in root.modules():
        for name, child in owner._modules.items():
            if isinstance(child, HookPoint):
                owner.__dict__[name] = child


def through(point: HookPoint, x: torch.Tensor, start: int | torch.Tensor = 0) -> torch.Tensor:
    """`x`, or what the point's hooks make of it when any is attached (no call at all otherwise)."""
    if not (point._forward_hooks or point._forward_pre_hooks):
        return x
    point.start = start
    return point(x)


def hook_points(model: nn.Module) -> dict[str, HookPoint]:
    """Every hook point of `model` by its name, in module order."""
    return {m.name: m for m in model.modules() if isinstance(m, HookPoint)}


def module_paths(model: nn.Module) -> dict[str, str]:
    """Every hook point's name -> its module path (`model.get_submodule(path)` reaches it)."""
    return {m.name: path for path, m in model.named_modules() if isinstance(m, HookPoint)}


def any_attached(points: Iterable[HookPoint]) -> bool:
    """Whether any of `points` has a hook (no look at them while no HookPoint in the process has one)."""
    return _LIVE[0] > 0 and any(p._forward_hooks or p._forward_pre_hooks for p in points)


def resolve(model: nn.Module, names: Sequence[str]) -> list[HookPoint]:
    """The points named `names`; InputError naming the first unknown one (and a few known ones)."""
    points = hook_points(model)
    out = []
    for name in names:
        if not isinstance(name, str) or name not in points:
            known = ", ".join(list(points)[:6])
            raise InputError(f"no hook point named {name!r:.80}; known points include {known}, ... (docs/hooks.md)")
        out.append(points[name])
    return out


@contextmanager
def hooks(model: nn.Module, fwd_hooks: Sequence[tuple[str, HookFn]] = ()) -> Iterator[list[HookPoint]]:
    """Attach `fn(module, args, output)` to each named point for the block; removed when it ends."""
    pairs = list(fwd_hooks)
    points = resolve(model, [name for name, _ in pairs])
    handles = []
    try:
        for point, (_, fn) in zip(points, pairs):
            handles.append(point.register_forward_hook(fn))
        yield points
    finally:
        for handle in handles:
            handle.remove()
        for point in points:
            point.start = 0


__all__ = ["HookPoint", "HookFn", "bind_points", "through", "hook_points", "module_paths", "any_attached", "resolve",
           "hooks"]
