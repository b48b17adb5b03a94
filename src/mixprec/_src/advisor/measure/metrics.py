"""Error measures: signal and noise power sums, SQNR in dB, fp16 range checks.

Powers are summed in float64 so that the figures do not depend on the summation order of a
float32 reduction. A low-precision tensor with an inf or NaN has infinite noise (SQNR ``-inf``);
one equal to the reference has zero noise (SQNR ``inf``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from mixprec._src.advisor.report.advice import Fp16Range

#: The largest finite float16 value.
FP16_MAX = 65504.0
#: The smallest magnitude that float16 rounds to infinity (65504 plus half an ulp; ties go to the
#: even mantissa, which is infinity's).
FP16_OVERFLOW = 65520.0


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


def fp16_overflows(t: torch.Tensor, scale: float = 1.0) -> int:
    """How many values of ``t * scale`` float16 rounds to infinity. Host sync: one."""
    return int((t.detach().abs().float() * scale >= FP16_OVERFLOW).sum())


def fp16_flushed(t: torch.Tensor, scale: float = 1.0) -> tuple[int, int]:
    """(non-zero values of ``t * scale`` that float16 rounds to zero, non-zero values).

    ``scale`` is a power of two, so ``t * scale`` is exact in float32. Host sync: one.
    """
    scaled = t.detach().float() * scale
    nonzero = scaled != 0
    flushed = nonzero & (scaled.to(torch.float16) == 0)
    return int(flushed.sum()), int(nonzero.sum())


def fp16_range(
    outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], scale: float
) -> Fp16Range:
    """How a module's reference ``outputs`` and gradients (of its parameters, output and
    inputs) fit float16, unscaled and at the loss ``scale``. Host sync: several."""
    present = [g for g in grads if g is not None and g.numel()]
    flushed = [0, 0, 0]  # unscaled, scaled, non-zero
    overflow = 0
    for g in present:
        a, n = fp16_flushed(g)
        b, _ = fp16_flushed(g, scale)
        flushed[0], flushed[1], flushed[2] = flushed[0] + a, flushed[1] + b, flushed[2] + n
        overflow += fp16_overflows(g, scale)
    nonzero = max(flushed[2], 1)
    return Fp16Range(
        output_overflow=sum(fp16_overflows(o) for o in outputs),
        output_max=max((float(o.abs().max()) for o in outputs if o.numel()), default=0.0),
        grad_max=max((float(g.abs().max()) for g in present), default=0.0),
        flushed_unscaled=flushed[0] / nonzero,
        flushed_scaled=flushed[1] / nonzero,
        grad_overflow_scaled=overflow,
    )
