"""What each device type can do: the one table every other module asks.

mixprec runs on every device PyTorch runs on. Some have torch's fused AMP kernels, fused
optimizers or a fast fp8 matmul; the rest take the general path (plain foreach/elementwise ops),
which computes the same values. Code never tests ``device.type == "cuda"`` or keeps a set of
device names of its own: it reads a column of this table.

A device type missing from the table (a PrivateUse1 backend, ``hpu``, ``mtia``...) gets
:data:`GENERAL`: every capability off, so the general path, which needs only ordinary tensor ops.

The scaler decides once, when it creates its scale, whether it may read the scale on the host
for free (:attr:`DeviceCaps.host_memory`). The tests run every scenario a second time with the
CPU's row replaced by CUDA's (``tests/conftest.py``), so the path a CUDA user takes is exercised
on every CI run.
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
            reference kernel, far slower than emulation: never use it there).
            Whether a given device of this type supports fp8 is a further runtime check.
        block_scaled_mm: ``torch.nn.functional.scaled_mm`` takes block scales here (MXFP8's
            1x32 E8M0 scales, NVFP4's 1x16 E4M3 scales with a tensor scale, 1x128 and 128x128
            fp32 scales) as a fast kernel. Which of them a given device runs is a further
            runtime check (its compute capability); the others take the emulated path.
        wide_float: the widest float dtype worth accumulating in (norms, sums, ``1/scale``).
        autocast_key: the name of native autocast's dispatch key for this type, if any.
        host_memory: tensors live in host memory, so reading one on the host costs no
            synchronisation: the scaler then follows its scale on the host and writes it back.
        aminmax_inf_norm: the inf-norm is much faster as ``torch.aminmax`` than as
            ``torch._foreach_norm(..., inf)`` (whose CPU kernel is not vectorised).
        per_tensor_clamp: one ``clamp_`` per large tensor beats two foreach clamps.
        sequential_pieces: small flat ranges run faster cut into pieces that torch runs on the
            calling thread (a parallel region may wait for its second thread on a busy machine).
        collective_backend: the ``torch.distributed`` backend that reduces tensors of this type
            (``gloo`` for the CPU, ``nccl`` for CUDA), for groups that do not say.

    Host sync: none.
    """

    amp_kernels: bool = False
    fused_optimizers: bool = False
    fp8_scaled_mm: bool = False
    block_scaled_mm: bool = False
    wide_float: torch.dtype = torch.float64
    autocast_key: str | None = None
    host_memory: bool = False
    aminmax_inf_norm: bool = False
    per_tensor_clamp: bool = False
    sequential_pieces: bool = False
    collective_backend: str | None = None


GENERAL = DeviceCaps()

_TABLE: dict[str, DeviceCaps] = {
    "cpu": DeviceCaps(
        amp_kernels=True,
        fused_optimizers=True,
        autocast_key="AutocastCPU",
        host_memory=True,
        aminmax_inf_norm=True,
        per_tensor_clamp=True,
        sequential_pieces=True,
        collective_backend="gloo",
    ),
    "cuda": DeviceCaps(
        amp_kernels=True,
        fused_optimizers=True,
        fp8_scaled_mm=True,
        block_scaled_mm=True,
        autocast_key="AutocastCUDA",
        collective_backend="nccl",
    ),
    "xpu": DeviceCaps(autocast_key="AutocastXPU", collective_backend="xccl"),
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


def types_reduced_by(backend: str) -> set[str]:
    """The device types whose tensors ``backend`` reduces (``"gloo"``: ``{"cpu"}``).

    Host sync: none.
    """
    return {kind for kind, row in _TABLE.items() if row.collective_backend == backend}


# Device types that have native autocast and none of the capabilities above (added by #17 so
# that autocast's device list and dispatch-key names come from this table).
for _kind, _key in (
    ("hpu", "AutocastHPU"),
    ("xla", "AutocastXLA"),
    ("ipu", "AutocastIPU"),
    ("mtia", "AutocastMTIA"),
    ("maia", "AutocastMAIA"),
    ("privateuseone", "AutocastPrivateUse1"),
):
    _TABLE.setdefault(_kind, DeviceCaps(autocast_key=_key))


def autocast_device_types() -> tuple[str, ...]:
    """The device types this table knows a native autocast dispatch key for, in table order.

    Example:
        >>> autocast_device_types()[:2]
        ('cpu', 'cuda')

    Host sync: none.
    """
    return tuple(kind for kind, c in _TABLE.items() if c.autocast_key is not None)
