"""Autocast: native ``torch.autocast`` underneath, with user policies and a dtype report.

Public API (re-exported from :mod:`mixprec`): :class:`autocast`, :class:`Policy`, :class:`Rule`,
:class:`DtypeReport`, :func:`policy_table`, :func:`custom_fwd`, :func:`custom_bwd`,
:func:`detach_hooks`.
"""

from __future__ import annotations

from mixprec.autocast._modules import detach_hooks
from mixprec.autocast.custom import custom_bwd, custom_fwd
from mixprec.autocast.native import check_native_table, native_op_table, registered_autocast_ops
from mixprec.autocast.policy import OpRule, Policy
from mixprec.autocast.region import autocast
from mixprec.autocast.report import DtypeReport, ReportRow
from mixprec.autocast.rules import Rule
from mixprec.autocast.table import PolicyTable, PolicyTableRow, policy_table

__all__ = [
    "DtypeReport",
    "OpRule",
    "Policy",
    "PolicyTable",
    "PolicyTableRow",
    "ReportRow",
    "Rule",
    "autocast",
    "check_native_table",
    "custom_bwd",
    "custom_fwd",
    "detach_hooks",
    "native_op_table",
    "policy_table",
    "registered_autocast_ops",
]
