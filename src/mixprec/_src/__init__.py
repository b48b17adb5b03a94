"""mixprec's implementation: private, importable only by mixprec itself and its tests.

Nothing here is a public API; users import from :mod:`mixprec`, :mod:`mixprec.errors`,
:mod:`mixprec.types`, :mod:`mixprec.distributed` and :mod:`mixprec.integrations`.
Layers (imports run downward only): ``kernels`` and ``dist`` know nothing of the scaler;
``scaling`` composes them; ``autocast`` knows nothing of the scaler.
"""
