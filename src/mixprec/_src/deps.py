"""Import an optional dependency, or say which extra installs it."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """Import ``module`` or raise an ImportError that names the extra to install.

    Host sync: none.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{purpose} needs the {module.split('.')[0]!r} package, which is not installed "
            f"({exc}). Install it with: pip install 'mixprec[{extra}]'"
        ) from exc
