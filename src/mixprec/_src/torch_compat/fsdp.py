"""FSDP2's private parameter layout, as the low-precision gather (``fp8/gather.py``) reads it.

``FSDPParam`` (``torch.distributed.fsdp._fully_shard._fsdp_param``), its ``FSDPParamGroup`` and
FSDP's state are private; this file is the part of the door (:mod:`mixprec._src.torch_compat`)
that reads them, re-exported from there.
"""

from __future__ import annotations

from typing import Any

import torch

# ---------------------------------------------------------------- FSDP2's parameters
# Checked on 2.13.0; CI runs them on 2.12.1 and 2.14.1.


# FSDP2's all-gather extension (fp8/gather.py): ``FSDPParam`` (torch.distributed.fsdp.
# _fully_shard._fsdp_param), its ``FSDPParamGroup`` and FSDP's state are private. Checked on
# torch 2.13.


def fsdp_param_group(module: Any) -> Any:
    """The ``FSDPParamGroup`` of an ``FSDPModule`` (None when it manages no parameter)."""
    return module._get_fsdp_state()._fsdp_param_group


def fsdp_lazy_init(module: Any) -> None:
    """Run FSDP2's lazy initialization of the root now (idempotent; it pads the shards)."""
    module._get_fsdp_state()._lazy_init()


def fsdp_padded_shard(fsdp_param: Any) -> torch.Tensor:
    """This rank's shard, zero-padded to the rows of the largest shard (2D: rows, cols)."""
    return fsdp_param._sharded_param_data.view(fsdp_param.padded_sharded_param_size)


def fsdp_shard_info(fsdp_param: Any) -> tuple[int, int, Any]:
    """``(rank, world size, process group)`` of the mesh dimension the parameter is sharded on."""
    info = fsdp_param.mesh_info
    return info.shard_mesh_rank, info.shard_mesh_size, info.shard_process_group


def fsdp_extension_ready(fsdp_param: Any) -> bool:
    """Whether the parameter has never been all-gathered (an extension can still be attached)."""
    return not hasattr(fsdp_param, "_unsharded_param") and not fsdp_param.all_gather_outputs


def fsdp_attach_extension(fsdp_param: Any, pre: Any, post: Any) -> None:
    """Give the sharded local tensor FSDP2's ``fsdp_pre_all_gather``/``fsdp_post_all_gather``
    (instance attributes: the parameter stays a plain tensor) and let FSDP see them."""
    local = fsdp_param.sharded_param._local_tensor
    local.fsdp_pre_all_gather = pre
    local.fsdp_post_all_gather = post
    fsdp_param._init_extensions()


def fsdp_param_dtype(fsdp_param: Any) -> torch.dtype:
    """The dtype FSDP2 gathers the parameter in (its MixedPrecisionPolicy's, else its own)."""
    return fsdp_param.param_dtype or fsdp_param.orig_dtype


def fsdp_unsupported(fsdp_param: Any) -> bool:
    """Whether the parameter is offloaded, sharded along another dim than 0, or on a 2-D mesh."""
    return bool(
        fsdp_param.offload_to_cpu
        or fsdp_param.fsdp_placement.dim != 0
        or fsdp_param.mesh_info.mesh.ndim != 1
    )


def fsdp_keeps_unsharded(group: Any) -> bool:
    """Whether the group keeps its parameters unsharded from forward to backward
    (``reshard_after_forward=False``, and FSDP's root)."""
    return group.post_forward_mesh_info is None


# FSDP2's parameter layout as the low-precision gather (fp8/gather.py) reads it: ``FSDPParam``
# and ``FSDPParamGroup`` (torch.distributed.fsdp._fully_shard) are private. Checked on 2.13.0.


def fsdp_params(group: Any) -> list[Any]:
    """The ``FSDPParam`` of an ``FSDPParamGroup``, in the order FSDP2 gathers them."""
    return list(group.fsdp_params)


def fsdp_sharded_param(fsdp_param: Any) -> torch.Tensor:
    """The sharded parameter (a DTensor) FSDP2 registers on the module between gathers."""
    return fsdp_param.sharded_param


def fsdp_param_owners(fsdp_param: Any) -> list[tuple[Any, str]]:
    """Every ``(module, attribute)`` the parameter is registered under: the module FSDP2 found
    it on first, then those sharing it (a weight tied between an embedding and a Linear)."""
    info = fsdp_param._module_info
    shared = zip(info.shared_modules, info.shared_param_names, strict=True)
    return [(info.module, info.param_name), *shared]


# --- gather1 ---


def fsdp_post_forward_shards(group: Any) -> int | None:
    """How many ranks an ``FSDPParamGroup`` shards its parameters over from forward to backward:
    its mesh's (``reshard_after_forward=True``), fewer (an int), None where it keeps them
    unsharded (``False``, and FSDP's root). Reads ``group.post_forward_mesh_info``, which
    ``set_reshard_after_forward`` also sets. Checked on 2.13.0."""
    info = group.post_forward_mesh_info
    return None if info is None else int(info.shard_mesh_size)
