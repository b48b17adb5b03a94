"""Shared test settings: small thread count so the suite behaves the same on 2 cores.

``scaler_path`` runs a test twice: on the CPU's own path and on the path a CUDA user takes
(``tests/scaler_paths.py``). Modules opt in with ``pytestmark = pytest.mark.usefixtures(
"scaler_path")``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from tests.scaler_paths import device_path

torch.set_num_threads(1)


@pytest.fixture(params=["host", "device"])
def scaler_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """``"host"``: the CPU's path; ``"device"``: the CUDA user's path, on the CPU."""
    if request.param == "host":
        yield "host"
        return
    with device_path():
        yield "device"
