"""Every private torch API and every piece of global torch state mixprec touches, in one place.

The rest of the package reaches torch's private names (``torch._C``, ``torch._foreach_*``,
``torch._dynamo``, ``torch._scaled_mm``, module hook dicts, ...) only through this module. Each
entry says what it is for, the torch versions it was checked on, and what mixprec does where the
name is missing; ``tests/test_torch_compat.py`` checks every entry on the torch it runs under.
"""

from __future__ import annotations

# ---------------------------------------------------------------- kernels, scaling, fp8, devices

# ---------------------------------------------------------------- autocast and the fp8 hook

# ---------------------------------------------------------------- the advisor


def compiled_original(module: object) -> object | None:
    """The eager module inside a ``torch.compile``'d one (``OptimizedModule._orig_mod``), or
    None for any other object. The advisor measures that module: its taps and isolated regions
    are forward hooks, which a compiled graph would trace once and replay.

    Checked on torch 2.4-2.13 (``torch._dynamo.eval_frame.OptimizedModule``); where the class is
    missing nothing is taken for compiled.
    """
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # a torch without dynamo
        return None
    return module._orig_mod if isinstance(module, OptimizedModule) else None
