"""The two code paths of the scaler, both run on the CPU.

On the CPU the scaler keeps its values on the host and writes the scale tensor when the rule
changes it (``DeviceCaps.host_memory``); on CUDA it runs the rule on the device and the host
derives the values when it reads them. :func:`device_path` makes the CPU take CUDA's branches:
its row of the device table (``mixprec._src.devices``) gets CUDA's scaler and kernel columns, and
the host path is made to fail loudly, so a test that runs under it exercises exactly what a
CUDA user runs (the same kernels, since the CPU has torch's AMP kernels as CUDA does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from mixprec._src import devices
from mixprec._src.scaling import state

# The columns the scaler and its kernels read; the others (autocast, fp8, collectives) stay.
SCALER_COLUMNS = (
    "amp_kernels",
    "fused_optimizers",
    "wide_float",
    "host_memory",
    "aminmax_inf_norm",
    "per_tensor_clamp",
    "sequential_pieces",
)


def _device_path_only(advance: Any) -> Any:
    def checked(self: state.ScaleState, *args: Any, **kwargs: Any) -> Any:
        if self._log is None:  # the host path would run: the test would not test the device path
            raise AssertionError(
                "the host path ran on the device path (host_memory should be False)"
            )
        return advance(self, *args, **kwargs)

    return checked


@contextmanager
def device_path() -> Iterator[None]:
    """Inside the block, scalers created on the CPU take the path a CUDA user takes."""
    cpu, cuda = devices._TABLE["cpu"], devices._TABLE["cuda"]
    like_cuda = dataclasses.replace(cpu, **{c: getattr(cuda, c) for c in SCALER_COLUMNS})
    saved = state.ScaleState.advance
    devices._TABLE["cpu"] = like_cuda
    state.ScaleState.advance = _device_path_only(saved)  # type: ignore[method-assign]
    try:
        yield
    finally:
        devices._TABLE["cpu"] = cpu
        state.ScaleState.advance = saved  # type: ignore[method-assign]
