"""The GPUs of the speed model: public peak figures and measured efficiencies.

Peaks are dense (no 2:4 sparsity) tensor-core throughputs per operand kind and the HBM
bandwidth, from NVIDIA's datasheets. The efficiencies (the fraction of a peak a large GEMM or a
streaming kernel reaches) come from published kernel-only measurements, never from a fit to the
figures the speed model is tested against: Hopper from TransformerEngine's pre-quantized GEMM
benchmark on an H200 NVL, Blackwell from the same benchmark on a B300, memory from torchao's
roofline (H100, B300). docs/advisor.md lists every source.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from mixprec.errors import ConfigError

T = 1e12
#: The shortest a kernel takes on these GPUs (a kernel that reads and writes one element),
#: torchao's roofline figure: a GEMM or a cast is never predicted below it.
KERNEL_FLOOR_S = 2e-6


@dataclass(frozen=True)
class GPU:
    """One GPU: its name, peaks, bandwidth and what its tensor cores run natively.

    Attributes:
        word: how ``advise(gpu=...)`` names it (``"h100"``).
        name: the datasheet's name.
        peak: dense FLOP/s per operand kind (``"fp32"``, ``"bf16"`` (fp16 alike), ``"fp8"``,
            ``"fp4"``); a kind that is missing has no tensor-core path on this GPU.
        bandwidth: HBM bytes/s.
        efficiency: fraction of ``peak`` a large GEMM reaches, per kind.
        memory_efficiency: fraction of ``bandwidth`` a streaming kernel (a cast) reaches.
        capability: the CUDA compute capability; a recipe runs in hardware where its
            capability range includes it (MXFP8 and NVFP4 from 10.0, torch's blockwise kernels
            on 9.x only).
    """

    word: str
    name: str
    peak: Mapping[str, float]
    bandwidth: float
    efficiency: Mapping[str, float]
    memory_efficiency: float
    capability: tuple[int, int]

    def rate(self, kind: str) -> float | None:
        """Achievable FLOP/s for ``kind``, None without a tensor-core path. Host sync: none."""
        peak = self.peak.get(kind)
        return None if peak is None else peak * self.efficiency[kind]

    @property
    def memory_rate(self) -> float:
        """Achievable bytes/s of a streaming kernel. Host sync: none."""
        return self.bandwidth * self.memory_efficiency


# Fractions of the datasheet peaks that TransformerEngine's kernel-only GEMM timings reach
# (docs/advisor.md, section "Speed", gives the timings and how they are divided).
_HOPPER = {"fp32": 0.718, "bf16": 0.718, "fp8": 0.684}
_BLACKWELL = {"fp32": 0.650, "bf16": 0.650, "fp8": 0.625, "fp4": 0.364}

GPUS: dict[str, GPU] = {
    "h100": GPU(
        "h100",
        "H100 SXM",
        {"fp32": 67 * T, "bf16": 989 * T, "fp8": 1979 * T},
        3.35 * T,
        _HOPPER,
        0.92,
        capability=(9, 0),
    ),
    "h200": GPU(
        "h200",
        "H200 SXM",
        {"fp32": 67 * T, "bf16": 989 * T, "fp8": 1979 * T},
        4.8 * T,
        _HOPPER,
        0.92,
        capability=(9, 0),
    ),
    "h200-nvl": GPU(
        "h200-nvl",
        "H200 NVL",
        {"fp32": 60 * T, "bf16": 835 * T, "fp8": 1670 * T},
        4.8 * T,
        _HOPPER,
        0.92,
        capability=(9, 0),
    ),
    "b200": GPU(
        "b200",
        "B200 (HGX)",
        {"fp32": 75 * T, "bf16": 2250 * T, "fp8": 4500 * T, "fp4": 9000 * T},
        8.0 * T,
        _BLACKWELL,
        0.84,
        capability=(10, 0),
    ),
    "b300": GPU(
        "b300",
        "B300 (HGX)",
        {"fp32": 75 * T, "bf16": 2250 * T, "fp8": 4500 * T, "fp4": 14000 * T},
        8.0 * T,
        _BLACKWELL,
        0.84,
        capability=(10, 3),
    ),
}


def get_gpu(name: object) -> GPU:
    """The GPU called ``name`` (``"h100"``, ``"h200"``, ``"h200-nvl"``, ``"b200"``,
    ``"b300"``; case and spaces ignored).

    Raises:
        ConfigError: another name or type; the message lists the known GPUs.
    """
    word = name.strip().lower().replace(" ", "-").replace("_", "-") if isinstance(name, str) else ""
    found = GPUS.get(word)
    if found is None:
        raise ConfigError(
            f"gpu {name!r} is not a GPU the speed model knows; known: "
            + ", ".join(repr(k) for k in GPUS)
        )
    return found
