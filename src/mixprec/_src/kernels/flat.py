"""Flat gradient storage: lay grads out as views into one buffer per (device, dtype).

:func:`flatten_grads` gives parameters such grads, so that the passes over them (unscale, check,
norm, clip) run on one range per buffer instead of one kernel per parameter; the plan finds such
ranges (:func:`mixprec._src.kernels.plan.flat_views`, which also recognises DDP's bucket views).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from mixprec.errors import ConfigError


class FlatGrads:
    """Parameters whose ``.grad`` are views into one flat buffer per (device, dtype).

    Made by :func:`flatten_grads`. After ``optimizer.zero_grad()`` with the default
    ``set_to_none=True`` a parameter's grad becomes None; the next backward's post-accumulate hook
    copies the fresh grad into the parameter's slot and puts the view back, so the layout survives
    (at the cost of one copy of that grad). ``zero_grad(set_to_none=False)`` zeroes the buffer in
    place and keeps the views without any copy: prefer it.

    Attributes:
        buffers: the flat buffers, keyed by (device, dtype).
        views: ``(parameter, view)`` of every flattened parameter, in order.
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self.views: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._slots: dict[int, torch.Tensor] = {}
        offsets: dict[tuple[torch.device, torch.dtype], int] = {}
        for param in params:
            key = (param.device, param.dtype)
            offsets[key] = offsets.get(key, 0) + param.numel()
        for (device, dtype), numel in offsets.items():
            self.buffers[(device, dtype)] = torch.zeros(numel, dtype=dtype, device=device)
        offsets = dict.fromkeys(offsets, 0)
        for param in params:
            key = (param.device, param.dtype)
            view = self.buffers[key][offsets[key] : offsets[key] + param.numel()].view_as(param)
            offsets[key] += param.numel()
            self.views.append((param, view))
            self._slots[id(param)] = view
        self._handles = [p.register_post_accumulate_grad_hook(self._reattach) for p in params]
        with torch.no_grad():
            for param, view in self.views:
                self._adopt(param, view)

    def _reattach(self, param: torch.Tensor) -> None:
        view = self._slots.get(id(param))
        if view is not None and param.grad is not view:
            with torch.no_grad():
                self._adopt(param, view)

    @staticmethod
    def _adopt(param: torch.Tensor, view: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            view.zero_()
        elif grad.layout is not torch.strided or grad.shape != view.shape or grad.requires_grad:
            # A sparse or reshaped grad, or one with a graph (backward(create_graph=True)):
            # left alone, so it keeps its meaning; it takes the per-tensor path.
            return
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
        param.grad = view

    def remove(self) -> None:
        """Stop re-attaching the views (grads already attached stay where they are).

        Host sync: none.
        """
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __repr__(self) -> str:
        sizes = ", ".join(f"{d}/{t}: {b.numel()}" for (d, t), b in self.buffers.items())
        return f"FlatGrads({len(self.views)} parameters; {sizes})"


def flatten_grads(model_or_params: torch.nn.Module | Iterable[Any]) -> FlatGrads:
    """Give parameters flat, contiguous grads: views into one zero-initialised buffer per
    (device, dtype), kept across ``optimizer.zero_grad()``.

    The scaler's unscale, check and clipping then run on each buffer as one tensor instead of
    one kernel per parameter (a large saving for models with many small parameters). Existing
    grads are copied into the buffer. Only parameters with ``requires_grad=True`` are flattened;
    call it after moving the model to its device and dtype, and before building anything that
    caches ``.grad`` tensors.

    Args:
        model_or_params: a module (its parameters) or an iterable of parameters or of optimizer
            param-group dicts.

    Returns:
        The :class:`FlatGrads` handle (its ``remove()`` stops the re-attaching hooks).

    Raises:
        ConfigError: an entry is not a tensor, or a parameter appears twice.

    Example:
        >>> import torch, mixprec
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
        >>> flat = mixprec.flatten_grads(model)
        >>> model(torch.randn(2, 4)).sum().backward()
        >>> buffer = flat.buffers[(torch.device("cpu"), torch.float32)]
        >>> model[0].weight.grad.data_ptr() == buffer.data_ptr()
        True

    Host sync: none.
    """
    return FlatGrads(_trainable(model_or_params))


def _trainable(model_or_params: torch.nn.Module | Iterable[Any]) -> list[torch.Tensor]:
    if isinstance(model_or_params, torch.nn.Module):
        items: list[Any] = list(model_or_params.parameters())
    else:
        items = []
        for item in model_or_params:
            items.extend(item["params"] if isinstance(item, dict) else [item])
    params: list[torch.Tensor] = []
    seen: set[int] = set()
    for item in items:
        if not isinstance(item, torch.Tensor):
            raise ConfigError(
                f"flatten_grads() takes a module or parameters; found a {type(item).__name__}. "
                "Pass model or model.parameters()."
            )
        if id(item) in seen:
            raise ConfigError(
                f"flatten_grads() was given the same parameter twice (shape {tuple(item.shape)});"
                " pass each parameter once."
            )
        seen.add(id(item))
        if item.requires_grad:
            params.append(item)
    return params
