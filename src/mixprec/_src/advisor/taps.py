"""Forward hooks that record (reference pass) or compare (later passes) one module's tensors.

A tap sees every call of its module: the floating outputs, the gradient of the module's floating
inputs (each input is replaced by an alias, ``t.view_as(t)``, so that the gradient recorded is
the one flowing through this module only, not through a residual branch that shares the
tensor), and, in the reference pass, the gradient of the outputs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn

from mixprec._src.advisor.metrics import Power
from mixprec._src.torch_compat import tree_flatten, tree_map

_SEQUENCE = itertools.count()


def _floating(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


class Record:
    """What the reference pass saw of one module, call by call (float32 copies)."""

    def __init__(self) -> None:
        self.input_grads: list[list[torch.Tensor | None]] = []
        self.outputs: list[list[torch.Tensor]] = []
        self.output_grads: list[list[torch.Tensor | None]] = []
        self.first_call = -1  # when it first ran, relative to other records (execution order)

    @property
    def calls(self) -> int:
        return len(self.outputs)


class Comparison:
    """Errors of one module's tensors against its :class:`Record`, summed over its calls."""

    def __init__(self) -> None:
        self.output = Power()
        self.input_grad = Power()


class Tap:
    """Hooks on one module: record into ``record`` or, when ``against`` is given, compare.

    ``scale`` is the loss scale of the pass (gradients are divided by it before comparing).
    """

    def __init__(
        self,
        module: nn.Module,
        against: Record | None = None,
        scale: float = 1.0,
    ) -> None:
        self.module = module
        self.against = against
        self.scale = scale
        self.record = Record()
        self.comparison = Comparison()
        self._call = 0
        self._handles: list[Any] = []

    def attach(self) -> None:
        self._handles = [
            self.module.register_forward_pre_hook(self._pre, with_kwargs=True),
            self.module.register_forward_hook(self._post),
        ]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _pre(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        call = self._call
        slots: list[torch.Tensor | None] = []
        if self.against is None:
            self.record.input_grads.append(slots)

        def alias(t: Any) -> Any:
            if not (_floating(t) and t.requires_grad):
                return t
            index = len(slots)
            slots.append(None)
            view = t.view_as(t)
            view.register_hook(self._input_grad_hook(call, index, slots))
            return view

        return tree_map(alias, (args, kwargs))

    def _input_grad_hook(
        self, call: int, index: int, slots: list[torch.Tensor | None]
    ) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            g = grad.detach().float() / self.scale
            if self.against is None:
                _accumulate(slots, index, g)
            elif call < self.against.calls and index < len(self.against.input_grads[call]):
                self.comparison.input_grad.add(g, self.against.input_grads[call][index])

        return hook

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        call = self._call
        self._call += 1
        outs = [t for t in tree_flatten(output)[0] if _floating(t)]
        if self.against is not None:
            if call < self.against.calls:
                self.comparison.output.add_all(
                    [o.detach().float() for o in outs], self.against.outputs[call]
                )
            return
        if call == 0:
            self.record.first_call = next(_SEQUENCE)
        self.record.outputs.append([o.detach().float().clone() for o in outs])
        grads: list[torch.Tensor | None] = [None] * len(outs)
        self.record.output_grads.append(grads)
        for i, o in enumerate(outs):
            if o.requires_grad:
                o.register_hook(_store_into(grads, i))


def _store_into(slots: list[torch.Tensor | None], index: int) -> Callable[[torch.Tensor], None]:
    def hook(grad: torch.Tensor) -> None:
        _accumulate(slots, index, grad.detach().float())

    return hook


def _to_float32(t: Any) -> Any:
    if isinstance(t, torch.Tensor) and t.dtype in (torch.float16, torch.bfloat16):
        return t.float()
    return t


def _accumulate(slots: list[torch.Tensor | None], index: int, grad: torch.Tensor) -> None:
    old = slots[index]
    slots[index] = grad.clone() if old is None else old + grad


@contextmanager
def attached(taps: list[Tap]) -> Iterator[None]:
    """Attach every tap for the duration of a pass."""
    try:
        for tap in taps:
            tap.attach()
        yield
    finally:
        for tap in taps:
            tap.detach()


@contextmanager
def around(module: nn.Module, make: Callable[[], AbstractContextManager[Any]]) -> Iterator[None]:
    """Run ``module``'s forward inside a fresh context from ``make()`` (entered by a pre-hook,
    left by an always-called post-hook); its 16-bit outputs are cast to float32, the dtype the
    rest of the model runs in during an isolated pass (the values are unchanged)."""
    stack: list[AbstractContextManager[Any]] = []

    def pre(mod: nn.Module, args: Any) -> None:
        ctx = make()
        ctx.__enter__()
        stack.append(ctx)

    def post(mod: nn.Module, args: Any, output: Any) -> Any:
        if stack:
            stack.pop().__exit__(None, None, None)
        return tree_map(_to_float32, output)

    handles = [
        module.register_forward_pre_hook(pre, prepend=True),
        module.register_forward_hook(post, always_call=True),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        while stack:
            stack.pop().__exit__(None, None, None)
