"""The unsharded weight of a low-precision all-gather: the recipe's cast weight, ready to multiply.

FSDP2 hands a module the tensor its ``fsdp_post_all_gather`` returns (:mod:`.gather`). For a
weight gathered in its recipe's format that tensor is a :class:`Gathered`: the weight's shape
and parameter dtype, no storage of its own, and the cast copies (:class:`~.casts.Quantized`:
codes and scales) that came over the wire. The recipe's matmul (``matmul.Fp8Linear``) asks
:func:`gathered` for the copy of the phase it runs (contracting along ``in_features`` in the
forward, along ``out_features`` for the input gradient) instead of casting the weight again;
a matmul other than the recipe's (an F.linear the rule did not serve) is refused, and any
other op reading the weight sees the forward copy's dequantized values.

NVFP4's e2m1 codes travel two to a byte (:func:`pack_e2m1`) and are unpacked here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mixprec._src import torch_compat
from mixprec._src.fp8.casts import Quantized, dequantize
from mixprec._src.fp8.recipes import E4M3, Cast
from mixprec.errors import ConfigError

_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass
class Payload:
    """What one gather brought: per orientation (0: forward, 1: input gradient) the cast weight.

    Attributes:
        name: the Linear's qualified name (for messages).
        casts: the recipe's weight cast per orientation.
        copies: the orientations this gather carried, by index.
    """

    name: str
    casts: tuple[Cast, ...]
    copies: dict[int, Quantized] = field(default_factory=dict)

    def get(self, dim: int) -> Quantized:
        """The copy that contracts along ``dim`` (1 forward, 0 input gradient)."""
        index = 0 if dim == 1 or len(self.casts) == 1 else 1
        found = self.copies.get(index)
        if found is None:
            raise ConfigError(
                f"the low-precision all-gather of Linear {self.name!r} carried no copy of its "
                f"weight for the {'forward' if index == 0 else 'input-gradient'} matmul: a forward "
                "recomputed in backward (activation checkpointing) needs both copies of a rowwise "
                "weight in the backward gather. Pass recompute=True to "
                "mixprec.distributed.gather_low_precision (under torchtitan: "
                "MixprecConverter.Config(recompute=True))."
            )
        return found


class Gathered(torch.Tensor):
    """The unsharded weight FSDP2 gave a module: shape and dtype of the parameter, the cast
    copies in :attr:`payload` (shared by its aliases, refilled at each gather).

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
        src = args[0]
        if func in _ALIASES and isinstance(src, Gathered):
            return Gathered(src.payload, src.shape, src.dtype, src.device)
        if func in _MATMULS:
            names = [a.payload.name for a in args if isinstance(a, Gathered)]
            raise ConfigError(
                f"the gathered low-precision weight of Linear {names[0]!r} reached {func}, not "
                "its recipe's matmul: the Linear's rule did not serve this call. Run its "
                "forward inside mixprec.autocast with the policy given to gather_low_precision."
            )
        return func(*torch_compat.tree_map(_values, args), **torch_compat.tree_map(_values, kwargs))


def _values(x: Any) -> Any:
    if not isinstance(x, Gathered):
        return x
    forward = x.payload.get(1)
    return dequantize(forward, x.payload.casts[0]).to(x.dtype)


_ALIASES: set[Callable[..., Any]] = {
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten.view.default,
    torch_compat.aten_unsafe_view,
}
_MATMULS: set[Callable[..., Any]] = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.linear.default,
    torch.ops.aten.matmul.default,
    torch.ops.aten.t.default,  # F.linear's own decomposition: an unserved call
}


def gathered(weight: torch.Tensor, dim: int) -> Quantized | None:
    """The gathered cast of ``weight`` that contracts along ``dim``, or None when ``weight``
    was not gathered in low precision (the matmul casts it).

    Raises:
        ConfigError: the gather did not carry that copy (names the Linear and the remedy).

    Host sync: none.
    """
    if not isinstance(weight, Gathered):
        return None
    return weight.payload.get(dim)


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
