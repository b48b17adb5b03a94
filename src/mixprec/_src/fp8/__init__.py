"""fp8 matmuls behind the ``"fp8"`` policy rule: recipes, scaled casts, the matmul paths, stats.

Layering: this package knows nothing of autocast or the scaler. ``mixprec._src.autocast`` calls
:func:`mixprec._src.fp8.hook.enter_modules` where an fp8 rule applies; everything else here
is plain tensor code (the emulated path) or ``torch._scaled_mm`` where the device table says it is
a fast kernel.
"""
