"""Low-precision matmuls behind the fp8-family policy rules (``"fp8"``, ``"fp8:rowwise"``,
``"fp8:rowwise_gw_hp"``, ``"fp8:blockwise"``, ``"mxfp8"``, ``"nvfp4"``): recipes as data, block
scaled casts, the matmul paths, stats.

Layering: this package knows nothing of autocast or the scaler. ``mixprec._src.autocast`` calls
:func:`mixprec._src.fp8.hook.enter_modules` where such a rule applies; everything else here is
plain tensor code (the emulated path) or ``torch._scaled_mm`` where the device table and the
device's compute capability say it is a fast kernel (:mod:`.kernels`).

- :mod:`.recipes`: :class:`~.recipes.Cast` and :class:`~.recipes.Recipe`, the recipes and rule
  words;
- :mod:`.formats`: the scale modes (torchao.float8's, DeepSeek-V3's, MX's E8M0, NVFP4's
  two-level), e2m1 rounding (to nearest and stochastic), the Hadamard transform;
- :mod:`.casts`: one block-scaled cast for every recipe, and its statistics;
- :mod:`.matmul`: the Linear's three matmuls (emulated or hardware); :mod:`.kernels`: the
  hardware calls; :mod:`.hook`: what a rule enters; :mod:`.stats`: ``Fp8Stats``.
"""
