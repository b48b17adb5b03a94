"""Autocast: native ``torch.autocast`` underneath, with user policies and a dtype report.

Public API (re-exported from :mod:`mixprec`): :class:`autocast`, :class:`Policy`, :class:`Rule`,
:func:`policy_table`, :func:`custom_fwd`, :func:`custom_bwd`; value types in :mod:`mixprec.types`.

The files, by concept: ``region`` (the region and what a full region adds on entry and exit),
``native`` (native autocast: device and dtype, the state switch, the op lists), ``rules`` (one
rule), ``targets`` (what a rule key names), ``policy`` (the policy value and its static table),
``tree`` (module names and the rule each module gets), ``calls`` (the thread's frames and module
calls), ``modules`` (the module hooks that apply rules, and checkpoint replay), ``traced`` (the
same while Dynamo traces), ``ops`` (op rules and their checkpoint replay), ``fp8`` (the checks
of fp8-family rules a forward cannot make), ``casting``, ``report``, ``custom``.
"""
