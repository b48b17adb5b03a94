"""Measuring: the guard around the model, the passes and their hooks, one module alone (whole or
per matmul), the error figures."""
