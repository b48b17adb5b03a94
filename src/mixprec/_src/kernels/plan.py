"""Gradients of an optimizer, grouped by (device, dtype) for one kernel launch per group.

Planning runs on every ``unscale_``/``step``/``clip_grad_norm_``, so it is kept cheap: the common
case (every grad present, dense, of one device and dtype) is recognised with C-level ``map`` calls
and no per-parameter Python loop. Groups whose grads tile contiguous ranges of shared buffers get
flat 1-D views of those ranges (:func:`flat_views`): DDP with ``gradient_as_bucket_view=True`` (one
range per bucket) and :func:`mixprec.flatten_grads` (one range); the passes then run on a few
large tensors instead of one per parameter. Anything else (gaps, overlaps, foreign tensors,
subclasses) keeps the per-tensor path, so no byte that is not a gradient is read or written.
When *every* group is flat, the plan is cached per optimizer and revalidated on each call from
the grads' identities, addresses and sizes (three ``map`` passes): such grads are views of a
long-lived buffer, so holding them costs no memory. Other plans are never cached, so that
``zero_grad(set_to_none=True)`` frees the grads as users expect.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch

from mixprec._src.devices import caps
from mixprec._src.torch_compat import tensor_base
from mixprec.errors import ConfigError

GroupKey = tuple[torch.device, torch.dtype]


@dataclass(frozen=True)
class ParamRef:
    """Where a parameter sits in an optimizer, for messages that name it."""

    group: int
    index: int
    name: str | None
    param: torch.Tensor

    def describe(self) -> str:
        """``'encoder.weight'`` when the optimizer knows names, else group, index and shape."""
        if self.name is not None:
            return self.name
        shape = "x".join(str(s) for s in self.param.shape) or "scalar"
        return f"param_groups[{self.group}]['params'][{self.index}] (shape {shape})"


@dataclass
class GradPlan:
    """One optimizer's gradients, ready for the unscale kernels.

    Attributes:
        dense: dense grads grouped by (device, dtype).
        sparse: parameters with a sparse grad (their values join ``dense`` at unscale time).
        low_precision: parameters whose dense grad is float16.
        missing: parameters without a grad.
        flat: for the dense groups whose grads tile contiguous ranges of shared buffers, 1-D
            views of those ranges (one per buffer).
        plain: every grad is known to be a plain ``torch.Tensor`` (no subclass, so no DTensor):
            no distributed agreement is needed unless a process group says so.
    """

    dense: dict[GroupKey, list[torch.Tensor]] = field(default_factory=dict)
    sparse: list[ParamRef] = field(default_factory=list)
    low_precision: list[ParamRef] = field(default_factory=list)
    missing: list[ParamRef] = field(default_factory=list)
    flat: dict[GroupKey, list[torch.Tensor]] = field(default_factory=dict)
    plain: bool = False
    _kernel_groups: dict[GroupKey, list[torch.Tensor]] | None = field(default=None, repr=False)

    def kernel_groups(self) -> dict[GroupKey, list[torch.Tensor]]:
        """The dense groups as the kernels should get them: flat ranges where there are some
        (cut into pieces on the CPU, see :func:`kernel_pieces`)."""
        if not self.flat:
            return self.dense
        if self._kernel_groups is None:
            self._kernel_groups = {
                key: kernel_pieces(self.flat[key]) if key in self.flat else grads
                for key, grads in self.dense.items()
            }
        return self._kernel_groups

    @property
    def devices(self) -> set[torch.device]:
        """Every device that holds at least one grad."""
        devs = {key[0] for key in self.dense}
        devs.update(ref.param.grad.device for ref in self.sparse if ref.param.grad is not None)
        return devs

    def all_grads(self) -> Iterator[torch.Tensor]:
        """Every dense grad, group after group."""
        for grads in self.dense.values():
            yield from grads


def iter_params(optimizer: torch.optim.Optimizer) -> Iterator[ParamRef]:
    """Every parameter of ``optimizer`` with its position and (if known) name.

    Raises:
        ConfigError: a ``params`` entry is not a tensor.
    """
    for g, group in enumerate(optimizer.param_groups):
        names = group.get("param_names")
        for i, param in enumerate(group["params"]):
            if not isinstance(param, torch.Tensor):
                raise ConfigError(
                    f"optimizer.param_groups[{g}]['params'][{i}] is a {type(param).__name__}, "
                    "not a torch.Tensor. Build the optimizer from model.parameters() or "
                    "model.named_parameters()."
                )
            name = names[i] if names is not None and i < len(names) else None
            yield ParamRef(g, i, name, param)


def group_grads(params: Iterable[torch.Tensor]) -> dict[GroupKey, list[torch.Tensor]]:
    """The dense grads of ``params`` grouped by (device, dtype), each group in the order given.

    This is how ``torch.nn.utils.clip_grad_norm_`` orders them, so a norm summed over these
    groups in this order is the same, bit for bit. Parameters without a grad are skipped.

    Raises:
        ConfigError: an entry is not a tensor.

    Host sync: none.
    """
    groups: dict[GroupKey, list[torch.Tensor]] = {}
    for i, param in enumerate(params):
        if not isinstance(param, torch.Tensor):
            raise ConfigError(
                f"parameters[{i}] is a {type(param).__name__}, not a torch.Tensor; pass "
                "model.parameters() or a list of parameters."
            )
        grad = param.grad
        if grad is not None and not grad.is_sparse:
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
    return groups


def plan_grads(optimizer: torch.optim.Optimizer) -> GradPlan:
    """Group the optimizer's grads by (device, dtype) and find the flat groups.

    Host sync: none.
    """
    if torch.compiler.is_compiling():  # the cache and the flat views read storage addresses,
        return _build_plan_slow(optimizer)  # which dynamo cannot trace: plain per-group plan
    grads = _current_grads(optimizer)
    cached = _CACHE.get(id(optimizer)) if _CACHE else None
    if cached is not None and grads is not None and cached.matches(grads):
        return cached.plan
    plan = _build_plan(optimizer, grads)
    for key, group in plan.dense.items():
        # autograd's own grads own their storage (no _base): not flat, as flat_views would say
        views = None if tensor_base(group[0]) is None else flat_views(group)
        if views is not None:
            plan.flat[key] = views
    if grads is not None and plan.flat and _cacheable(plan):  # no grad is None then
        _CACHE[id(optimizer)] = _CachedPlan(optimizer, cast("list[torch.Tensor]", grads), plan)
    elif cached is not None:
        del _CACHE[id(optimizer)]
    return plan


class _CachedPlan:
    """A plan whose every group is flat, with the key that says it still applies; the entry
    goes when its optimizer does (a weak reference's callback)."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, grads: list[torch.Tensor], plan: GradPlan
    ) -> None:
        key = id(optimizer)  # (the callback must not hold the entry: that would be a cycle)
        self.optimizer = weakref.ref(optimizer, lambda _: _CACHE.pop(key, None))
        self.grads = grads
        self.ptrs = list(map(torch.Tensor.data_ptr, grads))
        self.numels = list(map(torch.Tensor.numel, grads))
        self.plan = plan

    def matches(self, grads: Sequence[torch.Tensor | None]) -> bool:
        # Same tensor objects, still at the same addresses with the same sizes. Checking
        # identity first makes data_ptr/numel safe to call (no None left).
        return (
            len(grads) == len(self.grads)
            and all(map(operator.is_, grads, self.grads))
            and list(map(torch.Tensor.data_ptr, self.grads)) == self.ptrs
            and list(map(torch.Tensor.numel, self.grads)) == self.numels
        )


# Keyed by id (a plain dict: no Python-level lookup). An entry goes when its optimizer does, so
# an id is never reused while its entry is here.
_CACHE: dict[int, _CachedPlan] = {}


def _cacheable(plan: GradPlan) -> bool:
    return (
        not plan.missing
        and not plan.sparse
        and bool(plan.dense)
        and plan.flat.keys() == plan.dense.keys()
    )


def _current_grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor | None] | None:
    """Every param's grad, in order; None when a ``params`` entry is not a tensor."""
    groups = optimizer.param_groups
    if len(groups) == 1:
        params = groups[0]["params"]
    else:
        params = itertools.chain.from_iterable(group["params"] for group in groups)
    try:
        return list(map(_GRAD, params))
    except AttributeError:
        return None


_PLAIN = {torch.Tensor}
_GRAD = operator.attrgetter("grad")
_IS_SPARSE = operator.attrgetter("is_sparse")
_IS_CPU = operator.attrgetter("is_cpu")
_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")


def _build_plan(optimizer: torch.optim.Optimizer, grads: list | None) -> GradPlan:
    """The plan, without a per-parameter Python loop when every grad is dense and alike.

    Each test is one C-level ``map``: sparse (which also fails on a missing grad), dtype, device
    (``is_cpu`` first: it creates no device objects).
    """
    if grads:
        try:
            sparse = any(map(_IS_SPARSE, grads))
        except AttributeError:  # a grad is None
            sparse = True
        dtypes = set() if sparse else set(map(_DTYPE, grads))
        if len(dtypes) == 1:
            one_device = all(map(_IS_CPU, grads)) or len(set(map(_DEVICE, grads))) == 1
            if one_device:
                key = (grads[0].device, dtypes.pop())
                plan = GradPlan(dense={key: grads}, plain=set(map(type, grads)) == _PLAIN)
                if key[1] == torch.float16:
                    plan.low_precision = list(iter_params(optimizer))
                return plan
    return _build_plan_slow(optimizer)


def _build_plan_slow(optimizer: torch.optim.Optimizer) -> GradPlan:
    plan = GradPlan()
    for ref in iter_params(optimizer):
        grad = ref.param.grad
        if grad is None:
            plan.missing.append(ref)
            continue
        if grad.dtype == torch.float16:
            plan.low_precision.append(ref)
        if grad.is_sparse:
            plan.sparse.append(ref)
        else:
            plan.dense.setdefault((grad.device, grad.dtype), []).append(grad)
    return plan


# On the CPU a range of at most this many elements is handed to the kernels as pieces of
# _PIECE elements, which torch runs on the calling thread (TensorIterator opens a parallel region
# only above 32768 elements): a parallel op waits for its second thread to be scheduled, which on
# a loaded machine costs far more than the work (docs/performance.md). Above it, one thread is too
# slow to give up the parallel region.
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
        base = tensor_base(grad)
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
