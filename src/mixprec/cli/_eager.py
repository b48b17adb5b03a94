"""torch's Adam without the compile-time wrappers that import ``torch._dynamo``.

``torch.optim.Optimizer`` wraps ``add_param_group`` (run by every constructor) and
``zero_grad`` in ``torch._disable_dynamo``, and each optimizer's ``step`` in a graph break for
``torch.compile``; the first call of each imports ``torch._dynamo``, which takes seconds, longer
than a short demo. Outside ``torch.compile`` these wrappers change nothing, so the demo, which
compiles nothing, calls the functions they wrap.
The numbers are torch's: ``tests/docs/test_demo.py`` checks the demo's scaled run bit for bit
against
``torch.optim.Adam`` with ``torch.amp.GradScaler``.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec._src.torch_compat import without_dynamo_wrapper

__all__ = ["EagerAdam"]


class EagerAdam(torch.optim.Adam):
    """``torch.optim.Adam`` for eager loops that never compile (see the module docstring)."""

    add_param_group = without_dynamo_wrapper(torch.optim.Optimizer.add_param_group)
    zero_grad = without_dynamo_wrapper(torch.optim.Optimizer.zero_grad)

    def step(self, closure: Any = None) -> Any:
        """``torch.optim.Adam.step`` under ``torch.no_grad()`` (what its wrapper does when
        ``differentiable=False``).

        Host sync: none.
        """
        with torch.no_grad():
            return without_dynamo_wrapper(torch.optim.Adam.step)(self, closure)
