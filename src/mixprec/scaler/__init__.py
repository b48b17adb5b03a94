"""Dynamic loss scaling: settings, the update rule, the iteration protocol and the GradScaler."""

from __future__ import annotations
