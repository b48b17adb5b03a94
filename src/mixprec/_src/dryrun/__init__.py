"""The dry run: a training step on a meta copy of the model, routed as a named GPU would route
it, each hardware kernel call checked against CUDA's contract (``run.py``, ``rules.py``), and the
bytes each module saves for backward (``memory.py``)."""
