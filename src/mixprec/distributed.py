"""Every rank agrees: found-inf agreement and global gradient norms over a process group.

A :class:`~mixprec.GradScaler` built with ``process_group=group`` (or one whose gradients are
DTensors) turns each optimizer's local found-inf flag into a global one with one MAX all-reduce
per optimizer per iteration. The functions here are the same building blocks, for code that
clips or checks gradients itself. :func:`gather_low_precision` makes FSDP2 all-gather the weights of
low-precision-ruled Linears in their recipe's format. See ``docs/distributed.md``.
"""

from __future__ import annotations

from mixprec._src.autocast.fsdp import gather_low_precision
from mixprec._src.dist.agree import agree_found_inf_
from mixprec._src.dist.norms import all_reduce_norm_, distributed_clip_grad_norm_
from mixprec._src.fp8.gather import LowPrecisionGather
from mixprec._src.scaling.join import JoinableScaler

__all__ = [
    "JoinableScaler",
    "LowPrecisionGather",
    "agree_found_inf_",
    "all_reduce_norm_",
    "distributed_clip_grad_norm_",
    "gather_low_precision",
]
