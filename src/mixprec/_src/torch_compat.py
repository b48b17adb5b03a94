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


def _compiled_module_types() -> tuple[type, ...]:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # a torch without dynamo
        return ()
    return (OptimizedModule,)


#: The class of what ``torch.compile(module)`` returns (``OptimizedModule``, whose
#: ``_orig_mod`` is the eager module), for ``isinstance``. The advisor refuses such a module:
#: its taps and isolated regions are forward hooks, which a compiled graph traces once and
#: replays. Checked on torch 2.4-2.13; empty where the class is missing.
COMPILED_MODULE_TYPES: tuple[type, ...] = _compiled_module_types()
