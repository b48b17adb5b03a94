"""Passes over gradients: grouping, unscale + non-finite check."""
