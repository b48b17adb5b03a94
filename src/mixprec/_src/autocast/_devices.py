"""Device and dtype resolution for autocast regions.

The rule for ``device_type=None``: the device the user trains on, which is the current accelerator
reported by :mod:`torch.accelerator` (CUDA when available, also XPU, MPS, ...) when autocast is
available for it, and the CPU otherwise.
"""

from __future__ import annotations

import torch

from mixprec.errors import ConfigError

#: The dtypes an autocast region can lower to.
LOW_PRECISION_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)

_KNOWN_DEVICE_TYPES = (
    "cpu",
    "cuda",
    "xpu",
    "mps",
    "hpu",
    "xla",
    "ipu",
    "mtia",
    "maia",
    "privateuseone",
)


_VALID: set[object] = set()


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
    return [d for d in _KNOWN_DEVICE_TYPES if _autocast_available(d)]


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
        ConfigError: the device type is unknown or has no autocast support; the message lists the
            accepted device types.

    Host sync: none.
    """
    if device_type is None:
        return default_device_type()
    if isinstance(device_type, str) and device_type in _VALID:  # fast path: validated before
        return device_type
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
        raise ConfigError(
            f"device_type {device_type!r} has no autocast support in this torch build; "
            f"accepted device types: {', '.join(_accepted_device_types())}"
        )
    if name == device_type:
        _VALID.add(name)
    return name


def resolve_low_dtype(dtype: object, *, what: str = "dtype") -> torch.dtype:
    """Validate a low-precision dtype (``torch.float16`` or ``torch.bfloat16``).

    Example:
        >>> import torch
        >>> from mixprec._src.autocast._devices import resolve_low_dtype
        >>> resolve_low_dtype(torch.bfloat16)
        torch.bfloat16

    Raises:
        ConfigError: ``dtype`` is not a torch dtype, or is float64, float32, an integer or any
            other dtype; the message lists the accepted dtypes.

    Host sync: none.
    """
    if dtype is None:
        return torch.float16
    if dtype is torch.float16 or dtype is torch.bfloat16:
        return dtype
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(
            f"{what} must be a torch.dtype, got {type(dtype).__name__} {dtype!r}; "
            "accepted: torch.float16, torch.bfloat16"
        )
    if dtype not in LOW_PRECISION_DTYPES:
        hint = " (to run in float32, pass enabled=False)" if dtype == torch.float32 else ""
        raise ConfigError(
            f"{what}={dtype} is not a low-precision floating dtype autocast can lower to{hint}; "
            "accepted: torch.float16, torch.bfloat16"
        )
    return dtype
