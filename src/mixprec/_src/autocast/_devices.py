"""Device and dtype resolution for autocast regions.

The rule for ``device_type=None``: the device the user trains on, which is the current accelerator
reported by :mod:`torch.accelerator` (CUDA when available, also XPU, MPS, ...) when autocast is
available for it, and the CPU otherwise. The device types named in messages come from the shared
capability table (:func:`mixprec._src.devices.autocast_device_types`).

The dtype rule follows ``torch.autocast``: with a device type and no dtype, the device's current
autocast dtype (``torch.get_autocast_dtype``: bfloat16 for the CPU, float16 for CUDA, or what an
enclosing region set); with no device either (the ``torch.cuda.amp.autocast()`` call form), float16.
``dtype=torch.float32`` turns the region off (the computation stays in float32); with
``enabled=False`` any dtype is accepted, as torch does.
"""

from __future__ import annotations

import torch

from mixprec._src.devices import autocast_device_types
from mixprec.errors import ConfigError, UnsupportedDeviceError

#: The dtypes an autocast region can lower to.
LOW_PRECISION_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)


#: Device-type strings already validated (the fast path of a region built every step).
VALIDATED_DEVICE_TYPES: set[object] = set()


def default_device_type() -> str:
    """Return the device type a region uses when ``device_type`` is ``None``.

    The current accelerator (``torch.accelerator.current_accelerator()``: CUDA when available) when
    autocast is available for it, else ``"cpu"``.

    Example:
        >>> from mixprec._src.autocast import _devices as d
        >>> d.default_device_type() in ("cpu", "cuda", "xpu", "mps", "hpu", "mtia")
        True

    Host sync: none.
    """
    accel = getattr(torch, "accelerator", None)
    if accel is not None and accel.is_available():
        dev = accel.current_accelerator()
        if dev is not None and _autocast_available(dev.type):
            return dev.type
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def _autocast_available(device_type: str) -> bool:
    try:
        return bool(torch.amp.is_autocast_available(device_type))
    except RuntimeError:
        return False


def _accepted_device_types() -> list[str]:
    return [d for d in autocast_device_types() if _autocast_available(d)]


def resolve_device_type(device_type: str | torch.device | None) -> str:
    """Turn a user's ``device_type`` into the device type native autocast expects.

    Accepts ``None`` (see :func:`default_device_type`), a device type (``"cuda"``), a device string
    with an index (``"cuda:0"``) or a :class:`torch.device`.

    Example:
        >>> import torch
        >>> from mixprec._src.autocast._devices import resolve_device_type
        >>> resolve_device_type(torch.device("cpu"))
        'cpu'

    Raises:
        UnsupportedDeviceError: the device type is unknown or has no autocast support (also a
            ``RuntimeError``, as torch raises, and a ``ConfigError``); the message lists the
            accepted device types.
        ConfigError: ``device_type`` is not a string, a device or None.

    Host sync: none.
    """
    if device_type is None:
        return default_device_type()
    if isinstance(device_type, str) and device_type in VALIDATED_DEVICE_TYPES:
        return device_type  # validated before
    if isinstance(device_type, torch.device):
        name = device_type.type
    elif isinstance(device_type, str):
        name = device_type.split(":", 1)[0].strip()
    else:
        raise ConfigError(
            f"device_type must be a str, a torch.device or None, got {type(device_type).__name__} "
            f"{device_type!r}; accepted device types: {', '.join(_accepted_device_types())}"
        )
    if not _autocast_available(name):
        raise UnsupportedDeviceError(
            f"device_type {device_type!r} has no autocast support in this torch build; "
            f"accepted device types: {', '.join(_accepted_device_types())}"
        )
    if name == device_type:
        VALIDATED_DEVICE_TYPES.add(name)
    return name


def resolve_region_dtype(
    device: str, device_given: bool, dtype: object, enabled: bool
) -> tuple[torch.dtype, bool]:
    """The region's dtype and whether it casts at all, as ``torch.autocast`` decides them.

    Example:
        >>> import torch
        >>> resolve_region_dtype("cpu", True, None, True)
        (torch.bfloat16, True)
        >>> resolve_region_dtype("cpu", False, None, True)  # torch.cuda.amp.autocast() form
        (torch.float16, True)
        >>> resolve_region_dtype("cpu", True, torch.float32, True)  # float32: the region is off
        (torch.float32, False)

    Raises:
        ConfigError: ``dtype`` is not a torch dtype, or (when enabled) a dtype autocast cannot
            lower to other than float32 (float64, integers); the message lists the accepted ones.

    Host sync: none.
    """
    if dtype is None:
        return (torch.get_autocast_dtype(device) if device_given else torch.float16), enabled
    if dtype is torch.float16 or dtype is torch.bfloat16:
        return dtype, enabled
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(
            f"dtype must be a torch.dtype, got {type(dtype).__name__} {dtype!r}; "
            "accepted: torch.float16, torch.bfloat16 (torch.float32: autocast off)"
        )
    if dtype == torch.float32 or not enabled:
        return dtype, False
    raise ConfigError(
        f"dtype={dtype} is not a floating dtype autocast can lower to; accepted: torch.float16, "
        "torch.bfloat16, or torch.float32 (autocast off); with enabled=False any dtype is accepted"
    )
