"""Found-inf agreement: one MAX all-reduce of a 0-d flag, and the process-group helpers."""

from __future__ import annotations

from typing import Any

import torch

from mixprec._src.devices import types_reduced_by
from mixprec._src.torch_compat import process_group_device_types, public_attr
from mixprec.errors import ConfigError


def torch_dist() -> Any:
    import torch.distributed as dist

    return dist


def initialized() -> bool:
    """Whether torch.distributed is initialised in this process. Host sync: none."""
    dist = torch_dist()
    return bool(dist.is_available() and dist.is_initialized())


def dtensor_type() -> Any:
    """``DTensor`` when torch.distributed is initialised in this process, else None.

    Host sync: none.
    """
    if not initialized():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def validate_group(group: Any) -> Any:
    """``group`` itself when it is None or a ``torch.distributed.ProcessGroup``.

    Raises:
        ConfigError: anything else (names the type and what to pass).

    Host sync: none.
    """
    if group is None:
        return None
    dist = torch_dist()
    if dist.is_available() and isinstance(group, dist.ProcessGroup):
        return group
    raise ConfigError(
        f"process_group must be None or a torch.distributed.ProcessGroup, got "
        f"{type(group).__name__} ({group!r:.60}). Pass torch.distributed.group.WORLD for all "
        "ranks, or the group returned by torch.distributed.new_group(ranks)."
    )


def comm_device(group: Any, device: torch.device) -> torch.device:
    """``device`` when the group's backend can all-reduce there, else a device it can use.

    Host sync: none.
    """
    try:
        types = process_group_device_types(_group_object(group))
    except (AttributeError, RuntimeError):  # torch without ProcessGroup._device_types
        types = types_reduced_by(str(torch_dist().get_backend(group)))
    if not types or device.type in types:
        return device
    if "cpu" in types:
        return torch.device("cpu")
    kind = sorted(types)[0]
    module = public_attr(torch, kind, None)
    index = module.current_device() if module is not None else 0
    return torch.device(kind, index)


def _group_object(group: Any) -> Any:
    return group if group is not None else torch_dist().group.WORLD


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
    dist = torch_dist()
    target = comm_device(group, found_inf.device)
    buffer = found_inf if target == found_inf.device else found_inf.to(target)
    work = dist.all_reduce(buffer, op=dist.ReduceOp.MAX, group=group, async_op=True)
    work.wait()
    if buffer is not found_inf:
        found_inf.copy_(buffer)
    return found_inf
