"""Measuring: the guard around the model, the passes and their hooks, the error figures."""
