"""Global norms of sharded gradients: one all-reduce of the per-rank norms."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from mixprec._src.devices import caps
from mixprec._src.dist.agree import comm_device, dtensor_type, torch_dist

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
    dist = torch_dist()
    p = float(norm_type)
    value = local_norm.detach().float().reshape(())
    target = comm_device(group, value.device)
    if math.isinf(p):
        buffer = value.to(target, copy=True)
        op = dist.ReduceOp.MAX
    else:  # in float64 where there is one: norm ** p of a large finite norm fits
        buffer = value.to(target, caps(target).wide_float).pow(p)
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
    dtensor = dtensor_type()
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
