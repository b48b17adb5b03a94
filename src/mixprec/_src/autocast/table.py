"""The static view: the effective policy for a device, native lists plus the user's rules."""

from __future__ import annotations

from typing import NamedTuple

from torch import nn

from mixprec._src.autocast._devices import resolve_device_type
from mixprec._src.autocast._targets import class_label
from mixprec._src.autocast.native import native_op_table
from mixprec._src.autocast.policy import Policy, coerce_policy


class PolicyTableRow(NamedTuple):
    """One target: ``kind`` is ``"op"`` or ``"module"``; ``native`` is torch's policy or ``"-"``.

    Host sync: none.
    """

    kind: str
    target: str
    native: str
    rule: str
    effective: str


class PolicyTable:
    """Rows of :func:`policy_table`, printable. Host sync: none."""

    def __init__(self, device_type: str, rows: list[PolicyTableRow]) -> None:
        self.device_type = device_type
        self.rows = rows

    def __str__(self) -> str:
        head = PolicyTableRow("kind", "target", "native", "rule", "effective")
        cells = [head, *self.rows]
        widths = [max(len(r[i]) for r in cells) for i in range(5)]
        lines = [f"autocast policy for device_type={self.device_type!r}"]
        lines += ["  ".join(r[i].ljust(widths[i]) for i in range(5)).rstrip() for r in cells]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"PolicyTable({self.device_type!r}, {len(self.rows)} rows)"


def _op_rows(device_type: str, policy: Policy | None) -> list[PolicyTableRow]:
    native = native_op_table(device_type)
    rules = {} if policy is None else {op.name: op for op in policy.op_rules}
    rows: list[PolicyTableRow] = []
    for op, pol in native.items():
        base = op.removeprefix("aten::").split(".", 1)[0]
        user = rules.get(base)
        rule = "-" if user is None else str(user.rule)
        rows.append(PolicyTableRow("op", op, pol, rule, pol if user is None else rule))
    covered = {op.removeprefix("aten::").split(".", 1)[0] for op in native}
    for name, user in rules.items():
        if name not in covered:
            rows.append(PolicyTableRow("op", user.label, "-", str(user.rule), str(user.rule)))
    return rows


def _module_rows(policy: Policy, model: nn.Module | None) -> list[PolicyTableRow]:
    if model is not None:
        return [
            PolicyTableRow("module", name or "(root)", "-", str(rule), str(rule))
            for name, rule in policy.resolve(model).items()
        ]
    rows = [
        PolicyTableRow("module", class_label(cls), "-", str(rule), str(rule))
        for cls, rule in policy.class_rules.items()
    ]
    rows += [
        PolicyTableRow("module", glob, "-", str(rule), str(rule))
        for glob, rule in policy.name_rules.items()
    ]
    return rows


def policy_table(
    device_type: str | None = None,
    policy: Policy | str | None = None,
    model: nn.Module | None = None,
) -> PolicyTable:
    """The effective autocast policy for a device, without running anything.

    Native op policies come from the installed torch's dispatcher (see :mod:`.native`); user op
    rules override them by Python name; module rules are listed, or resolved to qualified names
    over ``model`` when one is given. ``policy`` is a :class:`~mixprec.Policy` or its string form,
    as everywhere else.

    Example:
        >>> import mixprec
        >>> t = mixprec.policy_table("cpu", mixprec.Policy("F.softmax=fp32, nn.LayerNorm=fp32"))
        >>> [r for r in t.rows if r.target == "aten::mm"][0].effective
        'lower_precision_fp'
        >>> [r.effective for r in t.rows if r.target == "F.softmax"]
        ['fp32']
        >>> [r.effective for r in mixprec.policy_table("cpu", "nn.Linear=fp32").rows][-1]
        'fp32'

    Raises:
        ConfigError: an unknown device type, a policy that is neither a Policy, a string nor
            None, or (with a strict policy and a model) a name glob that matches no module.

    Host sync: none.
    """
    dev = resolve_device_type(device_type)
    policy = coerce_policy(policy)
    rows = _op_rows(dev, policy)
    if policy is not None:
        rows += _module_rows(policy, model)
    return PolicyTable(dev, rows)
