"""What each device type can do: the one table every other module asks.

mixprec runs on every device PyTorch runs on. Some have torch's fused AMP kernels, fused
optimizers or a fast fp8 matmul; the rest take the general path (plain foreach/elementwise ops),
which computes the same values. Code never tests ``device.type == "cuda"`` or keeps a set of
device names of its own: it reads a column of this table.

A device type missing from the table (a PrivateUse1 backend, ``hpu``, ``mtia``...) gets
:data:`GENERAL`: every capability off, so the general path, which needs only ordinary tensor ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceCaps:
    """The capabilities of one device type.

    Attributes:
        amp_kernels: torch's ``_amp_foreach_non_finite_check_and_unscale_`` and
            ``_amp_update_scale_`` have kernels here (else the general path computes the same).
        fused_optimizers: torch's ``fused=True`` optimizers run here.
        fp8_scaled_mm: ``torch._scaled_mm`` is a fast kernel here (on the CPU it is oneDNN's
            reference kernel, thousands of times slower than emulation: never use it there).
            Whether a given device of this type supports fp8 is a further runtime check.
        wide_float: the widest float dtype worth accumulating in (norms, sums).
        autocast_key: the name of native autocast's dispatch key for this type, if any.

    Host sync: none.
    """

    amp_kernels: bool = False
    fused_optimizers: bool = False
    fp8_scaled_mm: bool = False
    wide_float: torch.dtype = torch.float64
    autocast_key: str | None = None


GENERAL = DeviceCaps()

_TABLE: dict[str, DeviceCaps] = {
    "cpu": DeviceCaps(amp_kernels=True, fused_optimizers=True, autocast_key="AutocastCPU"),
    "cuda": DeviceCaps(
        amp_kernels=True, fused_optimizers=True, fp8_scaled_mm=True, autocast_key="AutocastCUDA"
    ),
    "xpu": DeviceCaps(autocast_key="AutocastXPU"),
    "mps": DeviceCaps(wide_float=torch.float32, autocast_key="AutocastMPS"),
}


def caps(device: torch.device | str) -> DeviceCaps:
    """The capabilities of ``device``'s type (``"cuda:1"``, ``torch.device("cpu")``, ``"xpu"``).

    Example:
        >>> caps("cuda:0").amp_kernels
        True
        >>> caps("some_new_backend") is GENERAL
        True

    Host sync: none.
    """
    kind = device.type if isinstance(device, torch.device) else str(device).split(":", 1)[0]
    return _TABLE.get(kind, GENERAL)
