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
from mixprec.scaler.config import ScalerConfig
from mixprec.scaler.diagnostics import Diagnosis
from mixprec.scaler.grad_scaler import GradScaler
from mixprec.scaler.phases import OptState
from mixprec.scaler.telemetry import HistoryEntry, ScalerStats, UpdateEvent

# --- closures, master weights, NaN origin (owned by issue 9) ---
# isort: split
from mixprec.anomaly import (
    NonFiniteError,
    NonFiniteFinder,
    NonFiniteReport,
    OverflowRiskWarning,
    find_nonfinite,
)
from mixprec.master import MasterWeights

# --- autocast exports (owned by the autocast work) ---
# isort: split
from mixprec.autocast import (
    DtypeReport,
    Policy,
    PolicyTable,
    ReportRow,
    Rule,
    autocast,
    custom_bwd,
    custom_fwd,
    policy_table,
)

# --- integrations exports (owned by the integrations work; matplotlib is imported on call) ---
from mixprec.integrations.plot import plot

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "Diagnosis",
    "DtypeReport",
    "GradScaler",
    "HistoryEntry",
    "LowPrecisionGradError",
    "MasterWeights",
    "MissingGradError",
    "MixprecError",
    "MixprecWarning",
    "NonFiniteError",
    "NonFiniteFinder",
    "NonFiniteReport",
    "OptState",
    "OverflowRiskWarning",
    "Policy",
    "PolicyTable",
    "ReportRow",
    "Rule",
    "ScaleCollapseError",
    "ScaleCollapseWarning",
    "ScalerConfig",
    "ScalerStateError",
    "ScalerStats",
    "UpdateEvent",
    "__version__",
    "autocast",
    "custom_bwd",
    "custom_fwd",
    "find_nonfinite",
    "plot",
    "policy_table",
]
