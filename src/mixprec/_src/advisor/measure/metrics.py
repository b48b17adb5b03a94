"""Error measures: signal and noise power sums, SQNR in dB.

Powers are summed in float64 so that the figures do not depend on the summation order of a
float32 reduction. A low-precision tensor with an inf or NaN has infinite noise (SQNR ``-inf``);
one equal to the reference has zero noise (SQNR ``inf``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


class Power:
    """Running sums of reference power (signal) and error power (noise). Host sync: on add."""

    __slots__ = ("noise", "signal")

    def __init__(self, signal: float = 0.0, noise: float = 0.0) -> None:
        self.signal = signal
        self.noise = noise

    def add(self, low: torch.Tensor | None, ref: torch.Tensor | None) -> None:
        """Add one tensor pair (a missing tensor counts as zeros of the other's shape)."""
        if ref is None and low is None:
            return
        if ref is None:
            assert low is not None
            ref = torch.zeros_like(low, dtype=torch.float32)
        if low is None:
            low = torch.zeros_like(ref)
        ref64 = ref.detach().to(torch.float64)
        low64 = low.detach().to(torch.float64)
        self.signal += float(torch.sum(ref64 * ref64))
        if not bool(torch.isfinite(low64).all()):
            self.noise = math.inf
            return
        diff = low64 - ref64
        self.noise += float(torch.sum(diff * diff))

    def add_all(
        self, low: Iterable[torch.Tensor | None], ref: Iterable[torch.Tensor | None]
    ) -> None:
        """Add pairs from two sequences of equal length."""
        for a, b in zip(low, ref, strict=True):
            self.add(a, b)

    @property
    def ratio(self) -> float:
        """Noise power over signal power (0: exact; inf: non-finite or no signal)."""
        if self.noise == 0.0:
            return 0.0
        return self.noise / self.signal if self.signal > 0 else math.inf

    @property
    def sqnr(self) -> float:
        """Signal-to-quantization-noise ratio in dB."""
        return ratio_to_db(self.ratio)


def ratio_to_db(ratio: float) -> float:
    """SQNR in dB of a noise-to-signal power ratio (``inf`` for 0, ``-inf`` for inf)."""
    if ratio <= 0.0:
        return math.inf
    if math.isinf(ratio):
        return -math.inf
    return -10.0 * math.log10(ratio)


def db_to_ratio(db: float) -> float:
    """Noise-to-signal power ratio of an SQNR in dB (the inverse of :func:`ratio_to_db`)."""
    if math.isinf(db):
        return 0.0 if db > 0 else math.inf
    return 10.0 ** (-db / 10.0)
