"""Autocast: native ``torch.autocast`` underneath, with user policies and a dtype report.

Public API (re-exported from :mod:`mixprec`): :class:`autocast` (with
:meth:`autocast.detach_hooks`), :class:`Policy`, :class:`Rule`, :func:`policy_table`,
:func:`custom_fwd`, :func:`custom_bwd`; value types in :mod:`mixprec.types`.

The files, by concept: ``region`` (the region and what a full region adds on entry and exit),
``native`` (native autocast: device and dtype, the state switch, the op lists), ``rules`` (one
rule), ``targets`` (what a rule key names), ``policy`` (the policy value and its static table),
``modules`` (module rules: names, binding, per-module hooks), ``ops`` (op rules and their
checkpoint replay), ``fp8`` (what autocast does for fp8-family rules), ``casting``, ``report``,
``custom``.
"""
