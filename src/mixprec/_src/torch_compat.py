"""Every private torch API and every piece of global torch state mixprec touches, in one place.

The rest of the package reaches torch's private names (``torch._C``, ``torch._foreach_*``,
``torch._dynamo``, ``torch._scaled_mm``, module hook dicts, ...) only through this module. Each
entry says what it is for, the torch versions it was checked on, and what mixprec does where the
name is missing; ``tests/test_torch_compat.py`` checks every entry on the torch it runs under.
"""

from __future__ import annotations

import sys

# ---------------------------------------------------------------- kernels, scaling, fp8, devices

# ---------------------------------------------------------------- autocast and the fp8 hook

# ---------------------------------------------------------------- the advisor


def is_compiled_module(module: object) -> bool:
    """Whether ``module`` is what ``torch.compile(module)`` returns (``OptimizedModule``, whose
    ``_orig_mod`` is the eager module). The advisor refuses such a module: its taps and
    isolated regions are forward hooks, which a compiled graph traces once and replays.

    Checked on torch 2.4-2.13 (``torch._dynamo.eval_frame.OptimizedModule``). Nothing is
    imported: where dynamo was never imported, nothing was compiled.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    return optimized is not None and isinstance(module, optimized)
