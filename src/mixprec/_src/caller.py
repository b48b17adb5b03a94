"""Warnings that concern the caller point at the caller's line, not at mixprec's or torch's."""

from __future__ import annotations

import os
import sys
import warnings

import torch

# mixprec's own folder, found from this file (importing the package here would be a cycle)
_MIXPREC = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_INTERNAL = (_MIXPREC + os.sep, os.path.dirname(os.path.abspath(str(torch.__file__))) + os.sep)


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the first frame outside mixprec and torch.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_at_caller("look here")
        >>> caught[0].filename.startswith("<doctest")
        True

    Host sync: none.
    """
    frame = sys._getframe(1)
    level = 2
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
