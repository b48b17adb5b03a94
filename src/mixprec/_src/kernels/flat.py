"""Flat gradient storage: detect grads that tile contiguous ranges, and lay grads out that way.

When every grad of a (device, dtype) group is a contiguous view of a base tensor and the views of
each base tile one contiguous range of it with no gap and no overlap (DDP with
``gradient_as_bucket_view=True``: one range per bucket; :func:`flatten_grads`: one range), the
passes over the grads (unscale, check, norm, clip) run on those ranges instead of on each
parameter: one kernel call over a few large tensors instead of one per parameter.
Anything else (gaps, overlaps, foreign tensors, subclasses) keeps the per-tensor path, so no byte
that is not a gradient is ever read or written.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from mixprec._src.devices import caps
from mixprec.errors import ConfigError

# On the CPU a range of at most this many elements is handed to the kernels as pieces of
# _PIECE elements, which torch runs on the calling thread (TensorIterator opens a parallel region
# only above 32768 elements). Measured on the 2-core test machine, 2M fp32 elements unscale+check:
# one parallel op 0.12 ms when the machine is idle but ~26 ms (median) when other processes keep
# the cores busy (the op waits for its second thread to be scheduled), against 0.3-0.7 ms for the
# pieces in both cases. Above 4M elements one thread is too slow to give up the parallel region.
SEQUENTIAL_MAX_NUMEL = 1 << 22
_PIECE = 32768


def flat_views(grads: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
    """1-D views covering exactly the elements of ``grads``, one per base tensor; else None.

    Requirements: plain dense tensors of one device and dtype, contiguous, each a view of some
    base tensor; the grads of each base tile one contiguous range of it (sorted by address, each
    starts where the previous one ends: no gap, no overlap); and the ranges of different bases do
    not overlap (two bases may share memory, e.g. one made by ``detach()``). DDP with
    ``gradient_as_bucket_view=True`` gives one range per bucket; :func:`flatten_grads` one per
    (device, dtype).

    Host sync: none (addresses and sizes are metadata).
    """
    if not grads:
        return None
    by_base: dict[int, list[torch.Tensor]] = {}
    for grad in grads:
        base = grad._base
        if base is None:  # autograd's own grads own their storage: rejected at the first one
            return None
        if type(grad) is not torch.Tensor or grad.is_complex() or not grad.is_contiguous():
            return None
        by_base.setdefault(id(base), []).append(grad)
    views = []
    for group in by_base.values():
        view = _tile(group)
        if view is None:
            return None
        if view.numel():
            views.append(view)
    return views if _disjoint(views) else None


def flat_view(grads: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The single 1-D view covering exactly ``grads``, or None (see :func:`flat_views`).

    Host sync: none.
    """
    views = flat_views(grads)
    return views[0] if views is not None and len(views) == 1 else None


def _tile(group: list[torch.Tensor]) -> torch.Tensor | None:
    """The range that the grads of one base tile, or None; an empty view when all are empty."""
    spans = sorted(((g.data_ptr(), g.numel(), i) for i, g in enumerate(group) if g.numel()))
    if not spans:
        return group[0].reshape(-1)
    size = group[0].element_size()
    start, total, index = spans[0]
    for ptr, numel, _index in spans[1:]:
        if ptr != start + total * size:  # a gap (foreign bytes) or an overlap
            return None
        total += numel
    first = group[index]
    return first.as_strided((total,), (1,), first.storage_offset())


def _disjoint(views: list[torch.Tensor]) -> bool:
    ranges = sorted((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()) for v in views)
    return all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(ranges))


def kernel_pieces(views: list[torch.Tensor]) -> list[torch.Tensor]:
    """``views`` as the kernels should get them (see ``SEQUENTIAL_MAX_NUMEL``).

    Host sync: none.
    """
    if not views or not caps(views[0].device).sequential_pieces:
        return views
    if sum(v.numel() for v in views) > SEQUENTIAL_MAX_NUMEL:
        return views
    return [piece for v in views for piece in v.split(_PIECE)]


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
