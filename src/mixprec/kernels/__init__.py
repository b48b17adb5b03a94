"""Passes over gradients: grouping, unscale + non-finite check."""

from __future__ import annotations
