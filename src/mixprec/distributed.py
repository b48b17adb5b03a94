"""Every rank agrees: found-inf agreement and global gradient norms over a process group.

With DDP every rank holds the same all-reduced gradients, so every rank finds the same inf. With
sharded gradients (FSDP1, FSDP2/DTensor, ZeRO-style optimizers, tensor parallel) each rank checks
only its own shard, and a per-rank decision makes replicas diverge or collectives hang. A
:class:`~mixprec.GradScaler` built with ``process_group=group`` (or one whose gradients are
DTensors) therefore turns each optimizer's local found-inf flag into a global one with **one MAX
all-reduce per optimizer per iteration**, on every path (``unscale_``, plain ``step``, fused
optimizers), waited for before anything reads it. The flag stays 0-d (shape ``()``), as torch's
fused optimizers require.

What lives here:

* :func:`agree_found_inf_`: the all-reduce itself (also what a clipping routine calls).
* :func:`all_reduce_norm_` and :func:`distributed_clip_grad_norm_`: the global norm of sharded
  gradients with one all-reduce.
* :class:`JoinableScaler`: shadow iterations for ``torch.distributed.algorithms.Join`` so that
  ranks with fewer batches keep the same scale and counters.
* :class:`DistState`: the per-scaler bookkeeping the GradScaler shell calls (not public).

See ``docs/distributed.md`` for usage with DDP, FSDP1/FSDP2 and torchrun.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.algorithms.join import Joinable, JoinHook

from mixprec.errors import ConfigError
from mixprec.kernels.plan import GradPlan
from mixprec.scaler.phases import OptState

__all__ = [
    "DistState",
    "JoinableScaler",
    "agree_found_inf_",
    "all_reduce_norm_",
    "distributed_clip_grad_norm_",
]


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def _dtensor_type() -> Any:
    """``DTensor`` when torch.distributed is initialised in this process, else None."""
    dist = _dist()
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import DTensor
    return DTensor


def validate_group(group: Any) -> Any:
    """``group`` itself when it is None or a ``torch.distributed.ProcessGroup``.

    Raises:
        ConfigError: anything else (names the type and what to pass).
    """
    if group is None:
        return None
    dist = _dist()
    if dist.is_available() and isinstance(group, dist.ProcessGroup):
        return group
    raise ConfigError(
        f"process_group must be None or a torch.distributed.ProcessGroup, got "
        f"{type(group).__name__} ({group!r:.60}). Pass torch.distributed.group.WORLD for all "
        "ranks, or the group returned by torch.distributed.new_group(ranks)."
    )


def _comm_device(group: Any, device: torch.device) -> torch.device:
    """``device`` when the group's backend can all-reduce there, else a device it can use."""
    try:
        types = {d.type for d in _group_object(group)._device_types}
    except (AttributeError, RuntimeError):
        backend = str(_dist().get_backend(group))
        types = {"cpu"} if backend == "gloo" else {"cuda"} if backend == "nccl" else set()
    if not types or device.type in types:
        return device
    if "cpu" in types:
        return torch.device("cpu")
    kind = sorted(types)[0]
    module = getattr(torch, kind, None)
    index = module.current_device() if module is not None else 0
    return torch.device(kind, index)


def _group_object(group: Any) -> Any:
    return group if group is not None else _dist().group.WORLD


def agree_found_inf_(found_inf: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Make ``found_inf`` the maximum over all ranks of ``group``, in place; returns it.

    One ``all_reduce(MAX)``, waited for before returning, so whatever reads ``found_inf`` next
    sees the agreed value (with CPU offload too). A tensor on a device the group's backend
    cannot reduce on (a CUDA tensor with gloo) travels through a copy on a supported device.
    Every rank of ``group`` must call it the same number of times, in the same order.

    Args:
        found_inf: 0-d float32 flag (non-zero means inf/NaN was found on this rank).
        group: the process group; None is the default (world) group.

    Raises:
        ConfigError: ``found_inf`` is not 0-d (torch's fused optimizers need shape ``()``).

    Example:
        >>> import torch, torch.distributed as dist
        >>> from mixprec.distributed import agree_found_inf_
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> agree_found_inf_(torch.ones(()))  # the max over every rank's flag
        tensor(1.)
        >>> dist.destroy_process_group()

    Host sync: none on a backend that reduces on the tensor's device (NCCL on CUDA, gloo on
    CPU); a device-to-host copy when the tensor lives elsewhere (CUDA tensor, gloo group).
    """
    if found_inf.dim() != 0:
        raise ConfigError(
            f"found_inf must be a 0-d tensor (shape ()), got shape {tuple(found_inf.shape)}; "
            "torch's fused optimizers fail on shape (1,). Use found_inf.reshape(())."
        )
    dist = _dist()
    comm_device = _comm_device(group, found_inf.device)
    buffer = found_inf if comm_device == found_inf.device else found_inf.to(comm_device)
    work = dist.all_reduce(buffer, op=dist.ReduceOp.MAX, group=group, async_op=True)
    work.wait()
    if buffer is not found_inf:
        found_inf.copy_(buffer)
    return found_inf


def all_reduce_norm_(local_norm: torch.Tensor, norm_type: float, group: Any = None) -> torch.Tensor:
    """The global ``norm_type``-norm of gradients sharded over ``group``, from each rank's norm.

    One all-reduce: ``SUM`` of ``local_norm ** p`` then the ``p``-th root, or ``MAX`` for
    ``norm_type=inf``. A non-finite local norm makes the global one non-finite on every rank, so
    the result doubles as the found-inf agreement of a fused unscale+clip.

    Example:
        >>> import torch, torch.distributed as dist
        >>> from mixprec.distributed import all_reduce_norm_
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> all_reduce_norm_(torch.tensor(3.0), 2.0)  # sqrt of the sum of 3**2 over ranks
        tensor(3.)
        >>> dist.destroy_process_group()

    Args:
        local_norm: 0-d tensor, the norm of this rank's shards (0 for an empty shard).
        norm_type: p >= 1, or ``inf``.
        group: the process group; None is the default (world) group.

    Returns:
        A new 0-d float32 tensor on ``local_norm``'s device, equal on every rank.

    Host sync: as :func:`agree_found_inf_`.
    """
    dist = _dist()
    p = float(norm_type)
    value = local_norm.detach().float().reshape(())
    comm_device = _comm_device(group, value.device)
    if math.isinf(p):
        buffer = value.to(comm_device, copy=True)
        op = dist.ReduceOp.MAX
    else:  # in float64 where there is one: norm ** p of a large finite norm fits
        wide = torch.float32 if comm_device.type == "mps" else torch.float64
        buffer = value.to(comm_device, wide).pow(p)
        op = dist.ReduceOp.SUM
    dist.all_reduce(buffer, op=op, group=group, async_op=True).wait()
    total = buffer if math.isinf(p) else buffer.pow(1.0 / p)
    return total.to(value.device, torch.float32)


def _local_norm(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    norms = [torch.linalg.vector_norm(g.float(), norm_type) for g in grads if g.numel()]
    if not norms:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)


def distributed_clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    group: Any = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for gradients sharded over ``group`` (FSDP1, ZeRO).

    Each rank passes its own parameters (plain tensors or DTensors: their local shards are used);
    the norm is the global one, computed with one all-reduce (:func:`all_reduce_norm_`), and every
    rank scales its shards by the same ``min(1, max_norm / (norm + 1e-6))``. A non-finite norm
    leaves the grads as they are (``GradScaler.step`` skips that iteration). Call it after
    ``scaler.unscale_(optimizer)``.

    Returns:
        The global norm, a 0-d float32 tensor, equal on every rank.

    Example:
        >>> import torch, torch.distributed as dist
        >>> from mixprec.distributed import distributed_clip_grad_norm_
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> param = torch.nn.Parameter(torch.ones(4))
        >>> param.grad = torch.full((4,), 2.0)
        >>> distributed_clip_grad_norm_([param], max_norm=1.0)
        tensor(4.)
        >>> dist.destroy_process_group()

    Host sync: as :func:`agree_found_inf_`.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    dtensor = _dtensor_type()
    grads = []
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        if dtensor is not None and isinstance(grad, dtensor):
            grad = grad.to_local()
        grads.append(grad)
    device = grads[0].device if grads else torch.device("cpu")
    with torch.no_grad():
        total = all_reduce_norm_(_local_norm(grads, norm_type, device), norm_type, group)
        coef = (float(max_norm) / (total + 1e-6)).clamp(max=1.0)
        coef = torch.where(torch.isfinite(total), coef, torch.ones_like(coef))
        for grad in grads:
            grad.mul_(coef.to(grad.device, grad.dtype))
    return total


def _mesh_group(grads: Iterable[torch.Tensor]) -> Any:
    """The group spanning the device mesh of DTensor grads; None when no grad is a DTensor.

    Raises:
        ConfigError: grads on several different meshes, or on a multi-dimensional mesh that does
            not cover the whole world (pass ``process_group=`` then).
    """
    dtensor = _dtensor_type()
    if dtensor is None:
        return None
    meshes: list[Any] = []
    for grad in grads:
        if isinstance(grad, dtensor) and not any(grad.device_mesh == m for m in meshes):
            meshes.append(grad.device_mesh)
    if not meshes:
        return None
    mesh = meshes[0]
    if len(meshes) == 1 and mesh.ndim == 1:
        return mesh.get_group()
    if len(meshes) == 1 and mesh.size() == _dist().get_world_size():
        return _dist().group.WORLD
    raise ConfigError(
        f"This optimizer's gradients are DTensors on {len(meshes)} device mesh(es) "
        f"({', '.join(str(m) for m in meshes)}) and mixprec cannot pick one process group that "
        "spans them. Pass GradScaler(..., process_group=group) with a group containing every "
        "rank that holds a shard (torch.distributed.group.WORLD usually)."
    )


@dataclass
class DistState:
    """A GradScaler's distributed settings and counters (the shell calls it; not public).

    Attributes:
        group: the explicit process group, or None (then only DTensor grads trigger agreement).
        collectives: found-inf all-reduces issued since the last ``update()``.
        last_collectives: the same count for the previous iteration (Join's shadow iterations
            repeat it).
        total_collectives: all found-inf all-reduces this scaler issued (for measurements).
        joinable: the :class:`JoinableScaler` wrapping the scaler, if any.
    """

    group: Any = None
    collectives: int = 0
    last_collectives: int = 0
    total_collectives: int = 0
    joinable: Any = field(default=None, repr=False)

    def prepare(self, plan: GradPlan) -> tuple[GradPlan, Any, bool]:
        """``(plan with DTensor grads replaced by local shards, group, agree?)``.

        Also drops from ``plan.low_precision`` the fp16 grads of non-fp16 parameters (FSDP1's
        ``keep_low_precision_grads``): the optimizer still updates fp32 weights, so they are
        unscaled like torch's ShardedGradScaler does; fp16 *parameters* are still rejected.

        Host sync: none.
        """
        if plan.low_precision:  # (a comprehension over the empty list broke compile graphs)
            kept = [r for r in plan.low_precision if r.param.dtype == torch.float16]
            if len(kept) != len(plan.low_precision):
                plan = dataclasses.replace(plan, low_precision=kept)  # plans may be cached: copy
        dtensor = _dtensor_type()
        if dtensor is None:  # torch.distributed not initialised: no DTensors
            return plan, self.group, self.group is not None
        grads = list(plan.all_grads())
        if not any(isinstance(grad, dtensor) for grad in grads):
            return plan, self.group, self.group is not None
        group = self.group if self.group is not None else _mesh_group(grads)
        fresh: dict[str, Any] = (
            {"dense": {}, "flat": {}} if hasattr(plan, "flat") else {"dense": {}}
        )
        local = dataclasses.replace(plan, **fresh)  # no flat views of local shards
        for grad in grads:
            grad = grad.to_local() if isinstance(grad, dtensor) else grad
            local.dense.setdefault((grad.device, grad.dtype), []).append(grad)
        return local, group, True

    def agree_(
        self, found_inf_per_device: dict[torch.device, torch.Tensor], group: Any, device: Any
    ) -> None:
        """Replace the per-device flags by one agreed 0-d flag on ``device`` (one all-reduce).

        A rank without any flag (no grads) still takes part, with 0, so that no rank hangs; its
        dict stays empty so that its ``step``/``update`` raise ``MissingGradError`` as usual.

        Host sync: as :func:`agree_found_inf_`.
        """
        if self.joinable is not None:
            from torch.distributed.algorithms.join import Join

            Join.notify_join_context(self.joinable)
        flags = list(found_inf_per_device.values())
        # Reduce where the flags are (CPU-offloaded grads: on the CPU), then move the result.
        where = {flag.device for flag in flags}
        source = where.pop() if len(where) == 1 else torch.device(device)
        total = torch.zeros((), dtype=torch.float32, device=source)
        for flag in flags:
            total = total + flag.to(source, non_blocking=True)
        agreed = agree_found_inf_((total != 0).to(torch.float32), group).to(device)
        self.collectives += 1
        self.total_collectives += 1
        if flags:
            found_inf_per_device.clear()
            found_inf_per_device[torch.device(device)] = agreed

    def end_iteration(self) -> None:
        """Called by ``update()``: remember this iteration's collective count."""
        if self.collectives:
            self.last_collectives = self.collectives
        self.collectives = 0


class JoinableScaler(Joinable):
    """Lets a GradScaler take part in ``torch.distributed.algorithms.Join`` (uneven inputs).

    A rank that runs out of batches stops calling ``update()``; without help its growth counter
    and scale fall behind the others' (pytorch#90057). Inside ``Join([model, JoinableScaler(s)])``
    each iteration a joined rank still runs while others train becomes a *shadow iteration*: it
    takes part in the same number of found-inf all-reduces as a training rank (with 0) and calls
    ``update()`` with the agreed flag, so scale, growth counter and counters stay identical on
    every rank. The scaler must have been built with ``process_group=`` the join's group (DDP's,
    usually ``torch.distributed.group.WORLD``). List the model first: the first joinable signals
    the context each iteration, before its own collectives. A shadow iteration issues as many
    all-reduces as the joined rank's last real iteration did (one per optimizer), so every
    iteration must step the same optimizers.

    Args:
        scaler: the :class:`~mixprec.GradScaler` (enabled, with a process group).

    Raises:
        ConfigError: the scaler has no ``process_group``.

    Example:
        >>> import torch.distributed as dist, mixprec
        >>> from mixprec.distributed import JoinableScaler
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> scaler = mixprec.GradScaler(process_group=dist.group.WORLD)
        >>> JoinableScaler(scaler).join_process_group is dist.group.WORLD
        True
        >>> dist.destroy_process_group()

    Host sync: none at construction; a joined rank reads each shadow iteration's flag.
    """

    def __init__(self, scaler: Any) -> None:
        super().__init__()
        group = scaler._dist.group
        if group is None:
            raise ConfigError(
                "JoinableScaler needs a scaler that agrees across ranks: build it with "
                "GradScaler(..., process_group=torch.distributed.group.WORLD) (the same group as "
                "the DDP model's)."
            )
        self._scaler = scaler
        self._group = group
        scaler._dist.joinable = self

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook that runs shadow iterations. Host sync: none."""
        return _ScalerJoinHook(self._scaler, self._group, self.join_device)

    @property
    def join_device(self) -> torch.device:
        """Where the join context's own all-reduces run. Host sync: none."""
        scale = self._scaler._get_scale_async()
        device = scale.device if scale is not None else torch.device("cpu")
        return _comm_device(self._group, device)

    @property
    def join_process_group(self) -> Any:
        """The scaler's process group. Host sync: none."""
        return self._group


class _ScalerJoinHook(JoinHook):
    def __init__(self, scaler: Any, group: Any, device: torch.device) -> None:
        self._scaler = scaler
        self._group = group
        self._device = device
        self._keys = [object()]

    def main_hook(self) -> None:
        """One shadow iteration: the training ranks' all-reduces with 0, then ``update()``."""
        scaler = self._scaler
        state = scaler._lazy_init(self._device)
        count = max(1, scaler._dist.last_collectives)
        while len(self._keys) < count:
            self._keys.append(object())
        for key in self._keys[:count]:
            agreed = agree_found_inf_(torch.zeros((), device=state.scale.device), self._group)
            record = scaler._phases.get(key)
            record.found_inf_per_device = {agreed.device: agreed}
            record.stage = OptState.STEPPED
            record.skipped = bool(agreed.item() != 0)
        scaler._dist.collectives = count
        scaler.update()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Nothing to do: every shadow iteration already kept the state in step."""
