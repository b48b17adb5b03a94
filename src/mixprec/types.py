"""The value types mixprec returns, for type annotations and ``isinstance`` checks.

Users rarely build these themselves: ``GradScaler.stats()`` returns a :class:`ScalerStats`,
``autocast(..., report=True)`` a :class:`DtypeReport`, and so on. Every one is immutable or a
read-only view.
"""

from __future__ import annotations

from mixprec._src.advisor.report.advice import (
    Advice,
    Cheapest,
    Fp16Range,
    Measurement,
    ModuleAdvice,
    StepTime,
)
from mixprec._src.advisor.report.watch import WatchRecord, WatchReport
from mixprec._src.advisor.speed.model import Time
from mixprec._src.anomaly import NonFiniteFinder, NonFiniteReport
from mixprec._src.autocast.policy import PolicyTable, PolicyTableRow
from mixprec._src.autocast.report import DtypeReport, ReportRow
from mixprec._src.fp8.stats import Fp8CastStats, Fp8ModuleStats
from mixprec._src.kernels.flat import FlatGrads
from mixprec._src.scaling.phases import OptState
from mixprec._src.scaling.telemetry import Diagnosis, HistoryEntry, ScalerStats, UpdateEvent

__all__ = [
    "Advice",
    "Cheapest",
    "Diagnosis",
    "DtypeReport",
    "FlatGrads",
    "Fp8CastStats",
    "Fp8ModuleStats",
    "Fp16Range",
    "HistoryEntry",
    "Measurement",
    "ModuleAdvice",
    "NonFiniteFinder",
    "NonFiniteReport",
    "OptState",
    "PolicyTable",
    "PolicyTableRow",
    "ReportRow",
    "ScalerStats",
    "StepTime",
    "Time",
    "UpdateEvent",
    "WatchRecord",
    "WatchReport",
]
