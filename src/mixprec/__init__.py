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

# --- kernel exports (owned by the clipping/flat-storage work) ---
from mixprec.kernels.clip import NonFiniteNormError
from mixprec.kernels.flat import FlatGrads, flatten_grads

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

# --- distributed exports (owned by the distributed work) ---
# isort: split
from mixprec import distributed
from mixprec.distributed import JoinableScaler, distributed_clip_grad_norm_

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "Diagnosis",
    "DtypeReport",
    "FlatGrads",
    "GradScaler",
    "HistoryEntry",
    "JoinableScaler",
    "LowPrecisionGradError",
    "MasterWeights",
    "MissingGradError",
    "MixprecError",
    "MixprecWarning",
    "NonFiniteError",
    "NonFiniteFinder",
    "NonFiniteNormError",
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
    "distributed",
    "distributed_clip_grad_norm_",
    "find_nonfinite",
    "flatten_grads",
    "plot",
    "policy_table",
]
