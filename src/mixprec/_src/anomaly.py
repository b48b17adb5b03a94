"""Where did the first inf/NaN appear? A context manager that names the module, pass and dtype.

Under fp16 most NaN losses start as a forward overflow (an activation beyond 65504) in one layer;
the scaler only sees the gradients afterwards. :func:`find_nonfinite` hooks every module of a model
while its block runs: module outputs are checked in the forward pass (children before parents, so
the innermost module that produced the value is named; an output changed in place by a parent's
forward after its child returned it is checked again and blamed on that parent), and gradients
in the backward pass (the gradient each module's backward produces for its inputs, and its
parameters' gradients). The
first non-finite value found is kept in :attr:`NonFiniteFinder.report`; after that the hooks stop
checking. Nothing is registered outside the ``with`` block, so it costs nothing when not entered.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakTensorKeyDictionary

from mixprec._src import torch_compat
from mixprec._src.caller import warn_at_caller
from mixprec.errors import ConfigError, NonFiniteError, OverflowRiskWarning

_FP16_MAX = float(torch.finfo(torch.float16).max)


@dataclass(frozen=True)
class NonFiniteReport:
    """The first non-finite value seen.

    Attributes:
        module: qualified name of the module blamed (``""`` is the model itself).
        phase: ``"forward"`` or ``"backward"``.
        what: which tensor: ``"output"``, ``"input"`` (produced outside any submodule),
            ``"input gradient"`` (the module's backward produced it), ``"output gradient"``
            (it arrived from code outside any module, e.g. the loss) or
            ``"gradient of parameter 'NAME'"``.
        dtype: the tensor's dtype.
        max_finite: the largest finite magnitude in that tensor (0.0 when none is finite).
        detail: one sentence that says where to look.
    """

    module: str
    phase: str
    what: str
    dtype: torch.dtype
    max_finite: float
    detail: str

    def __str__(self) -> str:
        name = self.module or "<model>"
        return (
            f"First non-finite value: {self.phase} pass, {self.what} of '{name}' ({self.dtype}, "
            f"largest finite magnitude {self.max_finite:.4g}). {self.detail}"
        )


@dataclass
class _Tag:
    """Which modules produced and consumed a tensor, for blaming its gradient."""

    producer: str | None = None
    consumers: list[str] = field(default_factory=list)


def _float_tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.layout == torch.strided and value.numel():
            yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _float_tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _float_tensors(v)


def _stats(tensors: list[torch.Tensor]) -> list[tuple[bool, float]]:
    """(has non-finite, largest finite magnitude) per tensor, read in one host sync."""
    rows = []
    with torch.no_grad():
        for t in tensors:
            t = t.detach()
            bad = torch.logical_not(torch.isfinite(t).all()).float()
            biggest = torch.nan_to_num(t.abs().float(), nan=0.0, posinf=0.0).amax()
            rows.append(torch.stack([bad, biggest]).to(tensors[0].device, non_blocking=True))
    return [(bool(b), float(m)) for b, m in torch.stack(rows).tolist()]


def _leaf_most(names: list[str]) -> list[str]:
    """Drop names that are ancestors of another name in the list."""
    unique = list(dict.fromkeys(names))

    def is_ancestor(n: str, o: str) -> bool:
        return o != n and (n == "" or o.startswith(f"{n}."))  # "" is the model itself

    return [n for n in unique if not any(is_ancestor(n, o) for o in unique)]


class NonFiniteFinder:
    """Hooks a model while active; see :func:`find_nonfinite`.

    Attributes:
        report: the first :class:`NonFiniteReport`, or None.
        near_overflow: module name -> largest fp16 output magnitude above the ``warn_within``
            threshold.
    """

    def __init__(self, model: nn.Module, warn_within: float | None, raise_on_first: bool):
        if not isinstance(model, nn.Module):
            raise ConfigError(f"find_nonfinite needs an nn.Module, got {type(model).__name__}.")
        is_number = isinstance(warn_within, numbers.Real) and not isinstance(warn_within, bool)
        if warn_within is not None and not (is_number and float(warn_within) >= 1.0):
            raise ConfigError(
                f"warn_within must be None or a number >= 1 (e.g. 4.0: warn at 65504 / 4), got "
                f"{type(warn_within).__name__} {warn_within!r}."
            )
        if not isinstance(raise_on_first, bool):
            raise ConfigError(f"raise_on_first must be True or False, got {raise_on_first!r}.")
        self.model = model
        self.warn_within = None if warn_within is None else float(warn_within)
        self.raise_on_first = raise_on_first
        self.report: NonFiniteReport | None = None
        self.near_overflow: dict[str, float] = {}
        self._names: dict[nn.Module, str] = {}
        self._handles: list[RemovableHandle] = []
        self._tags: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self._checked: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self._active = False

    # ------------------------------------------------------------------ context

    def __enter__(self) -> NonFiniteFinder:
        self._active = True
        self._names = {m: n for n, m in self.model.named_modules()}
        model_hook = self.model.register_forward_pre_hook(self._check_model_input, with_kwargs=True)
        self._handles.append(model_hook)
        for module, name in self._names.items():
            self._handles.append(
                module.register_forward_pre_hook(self._tag_inputs, with_kwargs=True)
            )
            self._handles.append(
                module.register_forward_hook(self._check_outputs, with_kwargs=True)
            )
            for pname, param in module.named_parameters(recurse=False):
                if param.requires_grad:
                    hook = functools.partial(self._check_param_grad, name, pname)
                    self._handles.append(param.register_hook(hook))
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType
    ) -> None:
        self._active = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._tags = WeakTensorKeyDictionary()
        self._checked = WeakTensorKeyDictionary()

    @property
    def found(self) -> bool:
        """Whether a non-finite value was seen. Host sync: none."""
        return self.report is not None

    def reset(self) -> None:
        """Forget the report (and the near-overflow record) to look again. Host sync: none."""
        self.report = None
        self.near_overflow.clear()

    # ------------------------------------------------------------------ forward

    def _watching(self) -> bool:
        return self._active and self.report is None

    def _check_model_input(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        tensors = list(_float_tensors((args, kwargs)))
        if not self._watching() or not tensors:
            return
        for t, (bad, biggest) in zip(tensors, _stats(tensors), strict=True):
            if bad:
                detail = "The data given to the model already holds inf/NaN; check the inputs."
                self._found("", "forward", "input", t.dtype, biggest, detail)
                return

    def _tag_inputs(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if not self._watching():
            return
        name = self._names[module]
        for t in _float_tensors((args, kwargs)):
            if t.requires_grad:
                self._tag(t).consumers.append(name)

    def _check_outputs(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not self._watching():
            return
        # A parent returning its child's output tensor unchanged: already checked, no second
        # sync. Changed in place since (its version moved): checked again, and blamed here.
        checked = self._checked
        version = torch_compat.version_counter
        tensors = [t for t in _float_tensors(output) if checked.get(t) != version(t)]
        if not tensors:
            return
        for t in tensors:
            checked[t] = version(t)
        name = self._names[module]
        for t, (bad, biggest) in zip(tensors, _stats(tensors), strict=True):
            if bad:
                self._blame_forward(name, (args, kwargs), t, biggest)
                return
            self._check_margin(name, t, biggest)
        for t in tensors:
            if t.requires_grad:
                tag = self._tag(t)
                tag.producer = tag.producer or name
                if name in tag.consumers:  # returned its input: its backward passes grads on
                    tag.consumers.remove(name)

    def _blame_forward(self, name: str, inputs: Any, t: torch.Tensor, biggest: float) -> None:
        tensors = list(_float_tensors(inputs))
        if tensors and any(bad for bad, _ in _stats(tensors)):
            parent = name.rpartition(".")[0]
            detail = (
                f"The input of '{name}' was already non-finite: it was computed in the forward "
                f"of '{parent or '<model>'}' outside its submodules (a functional op there)."
            )
            self._found(parent, "forward", "input", t.dtype, biggest, detail)
            return
        detail = "Its inputs were finite: this module's own computation overflowed."
        if t.dtype == torch.float16:
            detail += " Run it in float32 (an fp32 island) or keep its activations smaller."
        self._found(name, "forward", "output", t.dtype, biggest, detail)

    def _check_margin(self, name: str, t: torch.Tensor, biggest: float) -> None:
        limit = None if self.warn_within is None else _FP16_MAX / self.warn_within
        if limit is None or t.dtype != torch.float16 or biggest < limit:
            return
        if name not in self.near_overflow:
            warn_at_caller(  # at the user's line that called the module
                f"fp16 output of '{name or '<model>'}' reached {biggest:.4g}, within a factor "
                f"{_FP16_MAX / biggest:.3g} of fp16's largest value {_FP16_MAX:.0f}: it may "
                "overflow soon. Consider running it in float32.",
                OverflowRiskWarning,
            )
        self.near_overflow[name] = max(biggest, self.near_overflow.get(name, 0.0))

    # ------------------------------------------------------------------ backward

    def _tag(self, t: torch.Tensor) -> _Tag:
        tag = self._tags.get(t)
        if tag is None:
            tag = self._tags[t] = _Tag()
            t.register_hook(functools.partial(self._check_grad, tag))
        return tag

    def _check_grad(self, tag: _Tag, grad: torch.Tensor) -> None:
        if not self._watching():
            return
        [(bad, biggest)] = _stats([grad])
        if not bad:
            return
        consumers = _leaf_most(tag.consumers)
        if consumers:
            others = f" (also consumed by {', '.join(consumers[1:])})" if consumers[1:] else ""
            detail = f"The backward of '{consumers[0]}'{others} produced it from finite gradients."
            self._found(consumers[0], "backward", "input gradient", grad.dtype, biggest, detail)
            return
        detail = (
            "It arrived at this module's output from computation outside any module (the loss "
            "or the code that uses the model's output)."
        )
        self._found(tag.producer or "", "backward", "output gradient", grad.dtype, biggest, detail)

    def _check_param_grad(self, module: str, pname: str, grad: torch.Tensor) -> None:
        if not self._watching():
            return
        [(bad, biggest)] = _stats([grad])
        if bad:
            detail = f"The backward of '{module or '<model>'}' produced it from finite gradients."
            what = f"gradient of parameter '{pname}'"
            self._found(module, "backward", what, grad.dtype, biggest, detail)

    def _found(
        self, module: str, phase: str, what: str, dtype: torch.dtype, biggest: float, detail: str
    ) -> None:
        self.report = NonFiniteReport(module, phase, what, dtype, biggest, detail)
        if self.raise_on_first:
            raise NonFiniteError(str(self.report))


def find_nonfinite(
    model: nn.Module, *, warn_within: float | None = None, raise_on_first: bool = False
) -> NonFiniteFinder:
    """A context manager that finds the first inf/NaN in ``model``'s forward or backward pass.

    Run the forward *and* the backward pass inside the block. Afterwards ``finder.report`` is a
    :class:`NonFiniteReport` (module name, pass, dtype, largest finite magnitude) or None.

    Args:
        model: the module to watch (all its submodules are hooked).
        warn_within: if set (e.g. ``4.0``), warn (:class:`OverflowRiskWarning`, once per module)
            when an fp16 module output exceeds ``65504 / warn_within``; the largest values are
            kept in ``finder.near_overflow``.
        raise_on_first: raise :class:`NonFiniteError` at the first non-finite value, from the
            hook, so the traceback points into the forward or backward where it happened.

    Raises:
        ConfigError: ``model`` is not a module, ``warn_within`` is not None or a number >= 1,
            or ``raise_on_first`` is not a bool.

    Example:
        >>> import torch, mixprec
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        >>> with torch.no_grad():
        ...     _ = model[1].weight.fill_(float("inf"))
        >>> with mixprec.find_nonfinite(model) as finder:
        ...     model(torch.randn(2, 4)).sum().backward()
        >>> finder.report.module, finder.report.phase
        ('1', 'forward')

    Host sync: none outside the block. Inside it, until the first non-finite value is found:
    one per module call in the forward pass (all new outputs of the call read together; a parent
    that returns its child's output tensor unchanged costs none), one per
    module-boundary tensor gradient and one per parameter gradient in the backward pass; none
    once a value has been found. It is a debugging tool: expect it to slow a step down.
    """
    return NonFiniteFinder(model, warn_within, raise_on_first)
