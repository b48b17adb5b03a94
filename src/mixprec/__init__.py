"""mixprec: automatic mixed precision for PyTorch.

A drop-in ``GradScaler`` and ``autocast`` that work on every device, never fail silently, and say
what went wrong.
"""

from __future__ import annotations

from mixprec.errors import (
    ConfigError,
    LowPrecisionGradError,
    MissingGradError,
    MixprecError,
    MixprecWarning,
    ScaleCollapseError,
    ScaleCollapseWarning,
    ScalerStateError,
)

# --- scaler exports (owned by the scaler work) ---

# --- autocast exports (owned by the autocast work) ---

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "LowPrecisionGradError",
    "MissingGradError",
    "MixprecError",
    "MixprecWarning",
    "ScaleCollapseError",
    "ScaleCollapseWarning",
    "ScalerStateError",
    "__version__",
]
