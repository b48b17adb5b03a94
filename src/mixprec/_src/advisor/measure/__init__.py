"""Measuring: which modules, the passes over the guarded model, the hooks, the error figures."""
