"""The unsharded weight of a low-precision all-gather: a cache of its rule's cast, never a value.

FSDP2 hands a module the tensor its ``fsdp_post_all_gather`` returns (:mod:`.gather`). For a
weight gathered in its recipe's format that tensor is a :class:`Gathered`: the weight's shape
and parameter dtype, no storage of its own, and the cast copies (:class:`~.casts.Quantized`:
codes and scales) that came over the wire. The gathered copy is a cache of one cast of the
weight, consulted in one place only:

* the recipe's matmul (``matmul.Fp8Linear``) asks :func:`gathered` for the copy of the phase it
  runs (contracting along ``in_features`` in the forward, along ``out_features`` for the input
  gradient) *and the cast its rule wants*: a copy of that cast is used as is (it is the fresh
  cast of the weight, bit for bit); a copy of another cast (a forward under another rule than
  the gather's: a ``Schedule``'s later phase) is not, the matmul casts the weight's own values
  (counted: ``LowPrecisionGather.recasts``);
* every other reader of the weight (a merge ``W + B @ A``, an embedding tied to the Linear,
  ``x @ W.t()``, any op) gets the weight's own values: the high-precision weight, all-gathered
  from the shards at the first such read (counted: ``LowPrecisionGather.high_gathers``) and
  kept until the next gather of a ruled weight, bit for bit what FSDP2's own gather gives.

NVFP4's e2m1 codes travel two to a byte (:func:`pack_e2m1`) and are unpacked here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mixprec._src import torch_compat
from mixprec._src.fp8.casts import Quantized
from mixprec._src.fp8.recipes import E4M3, Cast
from mixprec.errors import ConfigError

_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass
class Payload:
    """What one gather brought: per orientation (0: forward, 1: input gradient) the cast weight,
    and the way to the weight's own values.

    Attributes:
        name: the Linear's qualified name (for messages).
        casts: the gather's weight cast per orientation.
        fetch: all-gathers the weight's high-precision values from the shards (a collective).
        recast: called when a matmul wanted another cast than the gathered one.
        copies: the orientations this gather carried, by index.
        high: the high-precision weight, while a reader other than the recipe's matmul may read
            it again (dropped at the next gather of a ruled weight: deterministic on every rank,
            so every rank fetches at the same reads).
    """

    name: str
    casts: tuple[Cast, ...]
    fetch: Callable[[], torch.Tensor]
    recast: Callable[[], None]
    copies: dict[int, Quantized] = field(default_factory=dict)
    high: torch.Tensor | None = None

    def refill(self, copies: dict[int, Quantized]) -> None:
        """The copies of a new gather (the values read for the last one are dropped)."""
        self.copies, self.high = copies, None

    def values(self) -> torch.Tensor:
        """The weight's own values (high precision), fetched at the first read of a gather."""
        if self.high is None:
            self.high = self.fetch()
        return self.high

    def get(self, dim: int, cast: Cast) -> Quantized | None:
        """The copy that contracts along ``dim`` (1 forward, 0 input gradient) if it is the
        cast ``cast``; None if the gather's cast for that matmul is another one."""
        index = 0 if dim == 1 or len(self.casts) == 1 else 1
        if self.casts[index] != cast:
            self.recast()
            return None
        found = self.copies.get(index)
        if found is None:
            raise ConfigError(
                f"the low-precision all-gather of Linear {self.name!r} carried no copy of its "
                f"weight for the {'forward' if index == 0 else 'input-gradient'} matmul: a forward "
                "recomputed in backward (activation checkpointing) needs both copies of a weight "
                f"its recipe casts along each dimension ({_along(self.casts)}) in the backward "
                "gather. Pass recompute=True to "
                "mixprec.distributed.gather_low_precision (under torchtitan: "
                "MixprecConverter.Config(recompute=True))."
            )
        return found


def _along(casts: tuple[Cast, ...]) -> str:
    dims = ("in_features", "out_features")
    return ", ".join(f"{c.short} along {d}" for c, d in zip(casts, dims, strict=False))


class Gathered(torch.Tensor):
    """The unsharded weight FSDP2 gave a module: shape and dtype of the parameter, the cast
    copies in :attr:`payload` (shared by its aliases, refilled at each gather). An op on it
    other than an alias of the whole weight runs on the weight's own values.

    Host sync: none.
    """

    payload: Payload
    __torch_function__ = torch_compat.disabled_torch_function  # type: ignore[assignment]

    @staticmethod
    def __new__(
        cls, payload: Payload, shape: Any, dtype: torch.dtype, device: torch.device
    ) -> Gathered:
        out: Gathered = torch_compat.wrapper_subclass(cls, shape, dtype, device)
        out.payload = payload
        return out

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Gathered({self.payload.name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if _whole_alias(func, args, kwargs):
            src = args[0]
            return Gathered(src.payload, src.shape, src.dtype, src.device)
        return func(*torch_compat.tree_map(_values, args), **torch_compat.tree_map(_values, kwargs))


def _whole_alias(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """An alias of the whole weight (FSDP2's ``as_strided`` to the parameter's own size and
    stride, ``detach``, a ``view`` to its own shape): the cache travels with it."""
    src = args[0] if args else None
    if func not in _ALIASES or not isinstance(src, Gathered):
        return False
    if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
        return True
    shape = tuple(args[1]) if len(args) > 1 else ()
    if shape != tuple(src.shape):
        return False
    if func is torch.ops.aten.as_strided.default:
        stride = tuple(args[2]) if len(args) > 2 else ()
        offset = args[3] if len(args) > 3 else kwargs.get("storage_offset") or 0
        return stride == tuple(src.stride()) and not offset
    return True


def _values(x: Any) -> Any:
    return x.payload.values() if isinstance(x, Gathered) else x


_ALIASES: set[Callable[..., Any]] = {
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten.view.default,
    torch_compat.aten_unsafe_view,
}


def gathered(weight: torch.Tensor, dim: int, cast: Cast) -> Quantized | None:
    """The gathered cast of ``weight`` that contracts along ``dim``, if it is ``cast`` (the cast
    the running matmul's rule wants); None when ``weight`` was not gathered in low precision or
    was gathered in another cast (the matmul then casts the weight's own values).

    Raises:
        ConfigError: the gather did not carry that copy (names the Linear and the remedy).

    Host sync: none.
    """
    if not isinstance(weight, Gathered):
        return None
    return weight.payload.get(dim, cast)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 values (held in e4m3, one per byte, last dimension even) two to a byte: the sign
    and the index of the magnitude, the even element in the low nibble. A NaN becomes 0 (an
    NVFP4 tensor holding one has a NaN tensor scale: every value dequantizes to NaN anyway).

    Example:
        >>> c = torch.tensor([[0.5, -6.0, 0.0, 3.0]]).to(torch.float8_e4m3fn)
        >>> unpack_e2m1(pack_e2m1(c)).float().tolist()
        [[0.5, -6.0, 0.0, 3.0]]

    Host sync: none.
    """
    values = codes.to(torch.float32)
    table = torch.tensor(_E2M1_VALUES, device=codes.device)
    index = torch.bucketize(values.abs().nan_to_num(0.0), table).to(torch.uint8)
    nibble = index | (torch.signbit(values).to(torch.uint8) << 3)
    pairs = nibble.reshape(*nibble.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_e2m1`: e2m1 values held in e4m3. Host sync: none."""
    nibbles = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)
    table = torch.tensor(_E2M1_VALUES, device=packed.device)
    mag = table[(nibbles & 0x7).long()]
    values = torch.where((nibbles & 0x8) > 0, -mag, mag)
    return values.to(E4M3)
