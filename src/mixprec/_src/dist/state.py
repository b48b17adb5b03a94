"""The scaler's distributed bookkeeping: which group agrees, and the collectives it issued.

:class:`DistState` is what a GradScaler calls (not public): it turns DTensor grads into local
shards, finds the group their ranks agree over, issues the one all-reduce per optimizer per
iteration (:func:`~mixprec._src.dist.agree.agree_found_inf_` or, for a clip,
:func:`~mixprec._src.dist.norms.all_reduce_norm_`) and replays them in ``Join``'s shadow
iterations (:meth:`DistState.shadow_flags`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from mixprec._src.dist.agree import agree_found_inf_, dtensor_type, initialized, torch_dist
from mixprec._src.dist.norms import all_reduce_norm_
from mixprec._src.kernels.plan import GradPlan
from mixprec.errors import ConfigError


def _mesh_group(grads: Iterable[torch.Tensor]) -> Any:
    """The group spanning the device mesh of DTensor grads; None when no grad is a DTensor.

    Raises:
        ConfigError: grads on several different meshes, or on a multi-dimensional mesh that does
            not cover the whole world (pass ``process_group=`` then).
    """
    dtensor = dtensor_type()
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
    if len(meshes) == 1 and mesh.size() == torch_dist().get_world_size():
        return torch_dist().group.WORLD
    raise ConfigError(
        f"This optimizer's gradients are DTensors on {len(meshes)} device mesh(es) "
        f"({', '.join(str(m) for m in meshes)}) and mixprec cannot pick one process group that "
        "spans them. Pass GradScaler(..., process_group=group) with a group containing every "
        "rank that holds a shard (torch.distributed.group.WORLD usually)."
    )


def _shard_group(grads: Iterable[torch.Tensor]) -> Any:
    """The group over which DTensor grads are sharded (for summing norms).

    Replicated mesh dimensions (HSDP's replicas, tensor-parallel replicated parameters) must not
    be summed over. Supported: one mesh on which every grad is sharded on the same dimensions,
    either one dimension or all of a mesh that covers the world.

    Raises:
        ConfigError: other layouts (names them; says to clip with torch's DTensor-aware
            ``clip_grad_norm_`` after ``unscale_``).
    """
    dtensor = dtensor_type()
    layouts = {
        (grad.device_mesh, tuple(i for i, p in enumerate(grad.placements) if not p.is_replicate()))
        for grad in grads
        if isinstance(grad, dtensor)
    }
    if len(layouts) == 1:
        mesh, dims = layouts.pop()
        if len(dims) == 1:
            return mesh.get_group(dims[0])
        if len(dims) == mesh.ndim and mesh.size() == torch_dist().get_world_size():
            return torch_dist().group.WORLD
    raise ConfigError(
        "scaler.clip_grad_norm_ cannot tell which ranks to sum the norm over: this optimizer's "
        "DTensor gradients are sharded on several mesh layouts or mesh dimensions. Call "
        "scaler.unscale_(optimizer), then torch.nn.utils.clip_grad_norm_(params, max_norm), "
        "which reads the DTensor placements."
    )


@dataclass
class DistState:
    """A GradScaler's distributed settings and counters (the shell calls it; not public).

    Attributes:
        group: the explicit process group, or None (then only DTensor grads trigger agreement).
        issued: the all-reduces issued since the last ``update()``, in order: ``0.0`` for a
            found-inf MAX, ``p`` for the norm all-reduce of a clipping (``p`` > 0 or inf).
        last_issued: the same for the previous iteration (Join's shadow iterations replay it).
        total_collectives: all all-reduces this scaler issued (for measurements).
        join_group: the group of a ``JoinableScaler`` (flags only, never norms).
        joinable: the ``torch.distributed.algorithms.Joinable`` wrapping the scaler, if any: it
            is notified before the first all-reduce of every iteration.
    """

    group: Any = None
    join_group: Any = None
    issued: list[float] = field(default_factory=list)
    last_issued: list[float] = field(default_factory=list)
    total_collectives: int = 0
    joinable: Any = field(default=None, repr=False)

    def join(self, joinable: Any, group: Any) -> None:
        """Take part in ``Join``: agree on every flag over ``group``, notify ``joinable``.

        Host sync: none.
        """
        self.join_group = group
        self.joinable = joinable

    def prepare(self, plan: GradPlan) -> tuple[GradPlan, Any, bool]:
        """``(plan with DTensor grads replaced by local shards, group, agree?)``.

        The group is the explicit ``process_group``, else the DTensor grads' mesh group, else
        the join group of a :class:`~mixprec.distributed.JoinableScaler` (replicated grads under
        ``Join``). Also drops from ``plan.low_precision`` the fp16 grads of non-fp16 parameters
        (FSDP1's ``keep_low_precision_grads``): the optimizer still updates fp32 weights, so they
        are unscaled as torch's ShardedGradScaler does; fp16 *parameters* are still rejected.

        Host sync: none.
        """
        plan, flags, _ = self.prepare_clip(plan, norms=False)
        return plan, flags, flags is not None

    def prepare_clip(self, plan: GradPlan, norms: bool = True) -> tuple[GradPlan, Any, Any]:
        """``(local plan, group agreeing on the flag, group the grads are sharded over)``.

        Norms are summed over the third: the explicit ``process_group``, or the mesh dimensions
        DTensor grads are sharded on; None for replicated grads (DDP), whose norm is local.

        Host sync: none.
        """
        ungrouped = self.group is None and self.join_group is None and not plan.low_precision
        if ungrouped and (plan.plain or not initialized()):  # no DTensor grads: the common case
            return plan, None, None
        if plan.low_precision:  # (a comprehension over the empty list broke compile graphs)
            kept = [r for r in plan.low_precision if r.param.dtype == torch.float16]
            if len(kept) != len(plan.low_precision):
                plan = dataclasses.replace(plan, low_precision=kept)  # plans may be cached: copy
        dtensor = dtensor_type()
        grads = [] if dtensor is None else list(plan.all_grads())
        if dtensor is None or not any(isinstance(grad, dtensor) for grad in grads):
            if self.group is not None:
                return plan, self.group, self.group
            return plan, self.join_group, None
        flags = self.group if self.group is not None else _mesh_group(grads)
        sharded = self.group if self.group is not None or not norms else _shard_group(grads)
        fresh: dict[str, Any] = (
            {"dense": {}, "flat": {}} if hasattr(plan, "flat") else {"dense": {}}
        )
        local = dataclasses.replace(plan, **fresh)  # no flat views of local shards
        for grad in grads:
            grad = grad.to_local() if isinstance(grad, dtensor) else grad
            local.dense.setdefault((grad.device, grad.dtype), []).append(grad)
        return local, flags, sharded

    def agree_(
        self, found_inf_per_device: dict[torch.device, torch.Tensor], group: Any, device: Any
    ) -> None:
        """Replace the per-device flags by one agreed 0-d flag on ``device`` (one all-reduce).

        A rank without any flag (no grads) still takes part, with 0, so that no rank hangs; its
        dict stays empty so that its ``step``/``update`` raise ``MissingGradError`` as usual.

        Host sync: as :func:`agree_found_inf_`.
        """
        self._issue(0.0)
        flags = list(found_inf_per_device.values())
        # Reduce where the flags are (CPU-offloaded grads: on the CPU), then move the result.
        where = {flag.device for flag in flags}
        source = where.pop() if len(where) == 1 else torch.device(device)
        total = torch.zeros((), dtype=torch.float32, device=source)
        for flag in flags:
            total = total + flag.to(source, non_blocking=True)
        agreed = agree_found_inf_((total != 0).to(torch.float32), group).to(device)
        if flags:
            found_inf_per_device.clear()
            found_inf_per_device[torch.device(device)] = agreed

    def reduce_norm_(self, local_norm: torch.Tensor, norm_type: float, group: Any) -> torch.Tensor:
        """:func:`~mixprec.distributed.all_reduce_norm_`, logged (the clipping path's one
        all-reduce, which is also its found-inf agreement).

        Host sync: as :func:`agree_found_inf_`.
        """
        self._issue(float(norm_type))
        return all_reduce_norm_(local_norm, norm_type, group)

    def _issue(self, kind: float) -> None:
        if self.joinable is not None and not self.issued:  # once, before the first of them
            from torch.distributed.algorithms.join import Join

            Join.notify_join_context(self.joinable)
        self.issued.append(kind)
        self.total_collectives += 1

    def shadow_flags(self, group: Any, device: torch.device) -> list[torch.Tensor]:
        """A joined rank's stand-in for the last real iteration's all-reduces, each with 0
        (``torch.distributed.algorithms.Join``): one agreed flag per all-reduce (a clip's is the
        non-finiteness of the global norm). Host sync: as :func:`agree_found_inf_`."""
        kinds = self.last_issued or [0.0]
        flags = []
        for kind in kinds:
            zero = torch.zeros((), device=device)
            if kind == 0.0:  # a found-inf agreement
                flags.append(agree_found_inf_(zero, group))
            else:  # a clipping's norm
                total = all_reduce_norm_(zero, kind, group)
                flags.append(torch.logical_not(torch.isfinite(total)).to(torch.float32))
        self.issued = list(kinds)
        return flags

    def end_iteration(self) -> None:
        """Called by ``update()``: remember this iteration's all-reduces.

        Host sync: none.
        """
        if self.issued:
            self.last_issued = self.issued
        self.issued = []
