"""Autocast: native ``torch.autocast`` underneath, with user policies and a dtype report.

Public API (re-exported from :mod:`mixprec`): :class:`autocast`, :class:`Policy`, :class:`Rule`,
:class:`DtypeReport`, :func:`policy_table`, :func:`custom_fwd`, :func:`custom_bwd`,
:func:`detach_hooks`.
"""
