"""What a region with a policy or a report adds to native autocast, entered and undone exactly.

A region pushes a :class:`~._modules.Frame` (its device, dtype and policy, read by the module
hooks), takes the process-wide module hooks when it has module rules or a report, enters the op
rule mode when it has op rules, and records forward dtypes for a report. :func:`exit_machinery`
undoes what :func:`enter_machinery` did and, for a strict policy, refuses name rules that
matched no module run in the region.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec._src.autocast._modules import (
    TLS,
    Frame,
    acquire_global_hooks,
    release_global_hooks,
)
from mixprec._src.autocast._ops import OpRuleMode
from mixprec._src.autocast.policy import Policy
from mixprec._src.autocast.report import DtypeReport


class Entered:
    """What one ``__enter__`` of a full region did, so that ``__exit__`` can undo exactly that.

    Host sync: none.
    """

    __slots__ = ("frame", "hooks", "mode", "native", "recorder")

    def __init__(self, native: torch.autocast) -> None:
        self.native = native
        self.frame: Frame | None = None
        self.hooks = False
        self.mode: OpRuleMode | None = None
        self.recorder: Any = None  # set when the region records a report


def enter_machinery(
    entered: Entered,
    device: str,
    dtype: torch.dtype,
    policy: Policy | None,
    report: DtypeReport | None,
) -> None:
    """Push the region's frame and enter its hooks, op mode and recorder (after native entry).

    A region without a policy inherits the enclosing region's. Host sync: none.
    """
    tls = TLS
    if policy is None and tls.frames:
        policy = tls.frames[-1].policy
    enabled = bool(entered.native._enabled)
    frame = Frame(device, dtype, enabled, policy)
    frame.stack_len = len(tls.stack)
    if not tls.frames:
        tls.root, tls.root_map, tls.roots = None, {}, []  # names: roots run in this region
    tls.frames.append(frame)
    entered.frame = frame
    reporting = report is not None
    if (policy is not None and policy.has_module_rules) or reporting:
        acquire_global_hooks(post=reporting)
        entered.hooks = True
        tls.reporting += reporting
    if policy is not None and policy.op_rules and enabled:
        entered.mode = OpRuleMode(policy._op_table, device)
        entered.mode.__enter__()
    if report is not None:
        entered.recorder = report.record("forward")
        entered.recorder.__enter__()


def exit_machinery(entered: Entered, own_policy: Policy | None, clean: bool) -> None:
    """Undo :func:`enter_machinery` (before native exit).

    Raises:
        ConfigError: ``clean`` (no exception left the region), the region's own policy is
            strict, and one of its name rules matched no module that ran in the region.

    Host sync: none.
    """
    tls = TLS
    frame = entered.frame
    assert frame is not None
    reporting = entered.recorder is not None
    try:
        if entered.recorder is not None:
            entered.recorder.__exit__(None, None, None)
        if entered.mode is not None:
            entered.mode.__exit__(None, None, None)
    finally:
        if entered.hooks:
            release_global_hooks(post=reporting)
            tls.reporting -= reporting
        del tls.frames[tls.frames.index(frame) :]
        del tls.stack[frame.stack_len :]
    policy = frame.policy
    strict = clean and policy is not None and policy is own_policy and policy.strict
    if strict and policy is not None and policy.name_rules and frame.names_seen:
        error = policy._unmatched_error(sorted(frame.names_seen), "that ran in the region")
        if error is not None:
            raise error
