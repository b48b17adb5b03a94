"""mixprec: automatic mixed precision for PyTorch.

A drop-in ``GradScaler`` and ``autocast`` that work on every device, never fail silently, and say
what went wrong.

Public modules besides this one: :mod:`mixprec.errors` (every exception and warning),
:mod:`mixprec.types` (the value types mixprec returns, for annotations), :mod:`mixprec.distributed`
(found-inf agreement and global norms) and :mod:`mixprec.integrations` (Lightning, accelerate,
logging; never imported by ``import mixprec``). Everything under ``mixprec._src`` is private.
"""

from __future__ import annotations

from mixprec import distributed, errors, types
from mixprec._src.advisor.advise import advise
from mixprec._src.advisor.watch import Watch
from mixprec._src.anomaly import find_nonfinite
from mixprec._src.autocast.custom import custom_bwd, custom_fwd
from mixprec._src.autocast.fp8 import matmul_path
from mixprec._src.autocast.policy import Policy, policy_table
from mixprec._src.autocast.region import autocast
from mixprec._src.autocast.rules import Rule
from mixprec._src.autocast.schedule import Schedule
from mixprec._src.dist.norms import distributed_clip_grad_norm_
from mixprec._src.dryrun.run import dry_run
from mixprec._src.fp8.stats import Fp8Stats
from mixprec._src.kernels.flat import flatten_grads
from mixprec._src.master import MasterWeights
from mixprec._src.plot import plot
from mixprec._src.scaling.config import ScalerConfig
from mixprec._src.scaling.grad_scaler import GradScaler
from mixprec._src.scaling.join import JoinableScaler

__version__ = "0.1.0"

__all__ = [
    "Fp8Stats",
    "GradScaler",
    "JoinableScaler",
    "MasterWeights",
    "Policy",
    "Rule",
    "ScalerConfig",
    "Schedule",
    "Watch",
    "__version__",
    "advise",
    "autocast",
    "custom_bwd",
    "custom_fwd",
    "distributed",
    "distributed_clip_grad_norm_",
    "dry_run",
    "errors",
    "find_nonfinite",
    "flatten_grads",
    "matmul_path",
    "plot",
    "policy_table",
    "types",
]
