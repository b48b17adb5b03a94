"""Every private torch API and every piece of global torch state mixprec touches, in one place.

The rest of the package reaches torch's private names (``torch._C``, ``torch._foreach_*``,
``torch._dynamo``, ``torch._scaled_mm``, module hook dicts, ...) only through this module. Each
entry says what it is for, the torch versions it was checked on, and what mixprec does where the
name is missing; ``tests/test_torch_compat.py`` checks every entry on the torch it runs under.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

# ---------------------------------------------------------------- kernels, scaling, fp8, devices

# FSDP2's all-gather extension (fp8/gather.py): ``FSDPParam`` (torch.distributed.fsdp.
# _fully_shard._fsdp_param), its ``FSDPParamGroup`` and FSDP's state are private. Checked on
# torch 2.13.


def fsdp_param_group(module: Any) -> Any:
    """The ``FSDPParamGroup`` of an ``FSDPModule`` (None when it manages no parameter)."""
    return module._get_fsdp_state()._fsdp_param_group


def fsdp_lazy_init(module: Any) -> None:
    """Run FSDP2's lazy initialization of the root now (idempotent; it pads the shards)."""
    module._get_fsdp_state()._lazy_init()


def fsdp_param_owner(fsdp_param: Any) -> tuple[Any, str]:
    """The module and attribute name an ``FSDPParam`` was registered under."""
    info = fsdp_param._module_info
    return info.module, info.param_name


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


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (FSDP2's own test)."""
    return bool(torch._C._current_graph_task_id() != -1)


def preserve_version_counter(tensor: torch.Tensor) -> Any:
    """A context in which writes into ``tensor`` leave its version counter (and its views')
    as it was: FSDP2 refills its all-gather buffers the same way, so that the tensors autograd
    saved from them stay valid."""
    return torch.autograd.grad_mode._unsafe_preserve_version_counter(tensor)


def wrapper_subclass(cls: type, shape: Any, dtype: torch.dtype, device: torch.device) -> Any:
    """``torch.Tensor._make_wrapper_subclass``: a tensor subclass instance without storage."""
    return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)


disabled_torch_function = torch._C._disabled_torch_function_impl


def dynamo_disable(fn: Any) -> Any:
    """``torch._dynamo.disable``: ``fn`` runs eagerly when a compiled model calls it."""
    import torch._dynamo

    return torch._dynamo.disable(fn)


# ---------------------------------------------------------------- autocast and the fp8 hook

# ---------------------------------------------------------------- the advisor


def is_compiled_module(module: object) -> bool:
    """Whether ``module`` is what ``torch.compile(module)`` returns (``OptimizedModule``, whose
    ``_orig_mod`` is the eager module). The advisor refuses such a module: its taps and
    isolated regions are forward hooks, which a compiled graph traces once and replays.

    Checked on torch 2.4-2.13 (``torch._dynamo.eval_frame.OptimizedModule``). Nothing is
    imported: where dynamo was never imported, nothing was compiled.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    return optimized is not None and isinstance(module, optimized)
