"""Autocast: native ``torch.autocast`` underneath, with user policies and a dtype report.

Public API (re-exported from :mod:`mixprec`): :class:`autocast` (with
:meth:`autocast.detach_hooks`), :class:`Policy`, :class:`Rule`, :func:`policy_table`,
:func:`custom_fwd`, :func:`custom_bwd`; value types in :mod:`mixprec.types`.
"""
