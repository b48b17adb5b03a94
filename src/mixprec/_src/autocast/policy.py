"""``Policy``: per-module and per-op precision rules over native autocast, as a frozen value, and
:func:`policy_table`, its static view for a device (native op lists plus the user's rules)."""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

from torch import nn

from mixprec._src.autocast import fp8
from mixprec._src.autocast.native import native_op_table, resolve_device_type
from mixprec._src.autocast.rules import Rule, RuleLike, accepted_compute
from mixprec._src.autocast.targets import (
    OpRule,
    class_label,
    disagreeing,
    glob_tokens,
    module_places,
    parse_spec,
    resolve_module,
    resolve_op,
    unmatched_hint,
)
from mixprec.errors import ConfigError


def _check_arguments(spec: object, modules: object, ops: object, strict: object) -> None:
    if spec is not None and not isinstance(spec, str):
        raise ConfigError(f"Policy spec must be a string, got {type(spec).__name__}")
    for name, value in (("modules", modules), ("ops", ops)):
        if value is not None and not isinstance(value, Mapping):
            raise ConfigError(
                f"Policy {name}= must be a mapping of target to rule, got {type(value).__name__}"
            )
    if not isinstance(strict, bool):
        raise ConfigError(f"strict must be True or False, got {strict!r}")


def _build_state(
    spec: str | None,
    modules: Mapping[object, RuleLike] | None,
    ops: Mapping[object, RuleLike] | None,
    strict: bool,
) -> dict[str, object]:
    """Validate the rules and derive everything a policy reads (its instance dict)."""
    mods: dict[type[nn.Module] | str, Rule] = {}
    written: dict[type[nn.Module] | str, str] = {}  # each module target as first written
    oprules: dict[str, OpRule] = {}
    entries: list[tuple[bool, object, RuleLike]] = list(parse_spec(spec or ""))
    entries += [(False, k, v) for k, v in (modules or {}).items()]
    entries += [(True, k, v) for k, v in (ops or {}).items()]
    for is_op, key, value in entries:
        rule = Rule.coerce(value)
        if is_op:
            _add_op(oprules, key, rule)
        else:
            _add_module(mods, written, key, rule)
    classes = {k: r for k, r in mods.items() if isinstance(k, type)}
    globs = tuple((k, r) for k, r in mods.items() if isinstance(k, str))
    table = {name: op.rule for name, op in oprules.items()}
    key = (frozenset(classes.items()), globs, frozenset(table.items()), strict)
    return {
        "modules": MappingProxyType(mods),
        "ops": MappingProxyType({op.label: op.rule for op in oprules.values()}),
        "strict": strict,
        "_class_rules": classes,
        "_name_rules": globs,
        "_op_rules": tuple(oprules.values()),
        "_op_table": table,
        "_has_module_rules": bool(mods),
        "_key": key,
        "_hash": hash(key),
    }


_STATES: dict[tuple[object, ...], dict[str, object]] = {}
_STATES_LIMIT = 128


@dataclass(frozen=True, init=False, eq=False, repr=False)
class Policy:
    """Per-module and per-op precision rules for :class:`mixprec.autocast`: a frozen value.

    Module rules (by ``nn.Module`` class or qualified-name glob, ``*`` matching any characters
    including dots; names are relative to the root module called in the region) apply to every
    module that runs inside the region, with its whole subtree. A module reachable under several
    names (``nn.ModuleList([block] * 3)``) answers to each; names that take different rules are
    refused (:meth:`rule_for`). A class outside torch.nn is written ``"module:Qualname"``.
    Op rules (by torch function or op string) apply to calls of the public Python functions of
    that name (``torch.x``, ``torch.nn.functional.x``, ``Tensor.x``). Rules act only where native
    autocast is enabled for the region's device: a ``"fp32"`` or ``"keep"`` module is a closed
    island.

    A policy cannot be changed after construction. Two policies are equal (and hash equal) when
    they behave the same: the same class rules, the same name globs in the same order (the first
    match wins), the same op rules by Python name, the same ``strict``. Build a variant with
    ``dataclasses.replace(policy, strict=False)``.

    Args:
        spec: optional short string form, entries ``target=rule[@output]`` separated by commas.
            Targets naming torch classes (``nn.LayerNorm``, ``torch.nn.LayerNorm``) are module
            classes; targets naming torch functions (``F.softmax``,
            ``torch.nn.functional.softmax``, ``Tensor.softmax``, ``aten::gelu``) are ops; anything
            else is a qualified-name glob.
        modules: mapping of module class (or its ``nn.X`` name) or name glob to a rule.
        ops: mapping of torch function or op string to a rule.
        strict: raise :class:`ConfigError` when a name glob matches no module: at the end of a
            region, or in :meth:`resolve` (catches typos).

    Attributes:
        modules: read-only mapping of module class or glob to :class:`Rule`, in the order given.
        ops: read-only mapping of op label (``"F.softmax"``, ``"aten::gelu"``) to :class:`Rule`.
        strict: see above.

    Example:
        >>> import dataclasses
        >>> import torch
        >>> from torch import nn
        >>> import mixprec
        >>> p = mixprec.Policy(modules={nn.LayerNorm: "fp32"}, ops={"aten::gelu": "low"})
        >>> str(p)
        'nn.LayerNorm=fp32, aten::gelu=low'
        >>> mixprec.Policy(str(p)) == p and hash(mixprec.Policy(str(p))) == hash(p)
        True
        >>> dataclasses.replace(p, strict=False) == p
        False

    Raises:
        ConfigError: an unknown target, a non-Module class, a function given as a module rule
            (or a class as an op rule), an op that does not exist, a rule kind the target does not
            accept (``"promote"`` for a module), or conflicting rules for one op name.

    Host sync: none.
    """

    modules: Mapping[type[nn.Module] | str, Rule]
    ops: Mapping[str, Rule]
    strict: bool
    # Derived once at construction; read on hot paths (module hooks, the op-rule mode).
    _class_rules: dict[type, Rule] = field(init=False, repr=False)
    _name_rules: tuple[tuple[str, Rule], ...] = field(init=False, repr=False)
    _op_rules: tuple[OpRule, ...] = field(init=False, repr=False)
    _op_table: dict[str, Rule] = field(init=False, repr=False)
    _key: tuple[object, ...] = field(init=False, repr=False)
    _hash: int = field(init=False, repr=False)
    _has_module_rules: bool = field(init=False, repr=False)

    def __init__(
        self,
        spec: str | None = None,
        *,
        modules: Mapping[object, RuleLike] | None = None,
        ops: Mapping[object, RuleLike] | None = None,
        strict: bool = True,
    ) -> None:
        _check_arguments(spec, modules, ops, strict)
        memo: tuple[object, ...] | None = (
            spec,
            tuple(modules.items()) if modules else (),
            tuple(ops.items()) if ops else (),
            strict,
        )
        try:  # per-step construction from the same literals is a lookup (the state is immutable)
            state = _STATES.get(memo)  # type: ignore[arg-type]
        except TypeError:  # an unhashable key or rule: build without the memo
            memo, state = None, None
        if state is None:
            state = _build_state(spec, modules, ops, strict)
            if memo is not None:
                if len(_STATES) >= _STATES_LIMIT:
                    _STATES.pop(next(iter(_STATES)))
                _STATES[memo] = state
        self.__dict__.update(state)  # frozen: the one write, before anyone sees the object

    # ------------------------------------------------------------------ derived views
    @property
    def has_module_rules(self) -> bool:
        """Whether any module rule exists. Host sync: none."""
        return self._has_module_rules

    @property
    def op_rules(self) -> tuple[OpRule, ...]:
        """The op rules, in the order given. Host sync: none."""
        return self._op_rules

    @property
    def op_table(self) -> Mapping[str, Rule]:
        """Python op name -> rule (what the op interceptor matches), read-only. Host sync: none."""
        return MappingProxyType(self._op_table)

    @property
    def class_rules(self) -> Mapping[type[nn.Module], Rule]:
        """Module class -> rule, read-only. Host sync: none."""
        return MappingProxyType(self._class_rules)

    @property
    def name_rules(self) -> Mapping[str, Rule]:
        """Qualified-name glob -> rule, read-only, in the order they are tried. Host sync: none."""
        return MappingProxyType(dict(self._name_rules))

    # ------------------------------------------------------------------ matching
    def module_rule(self, module: nn.Module, name: str | None) -> Rule | None:
        """The rule for one module: the first matching name glob, else the nearest class rule.

        Example:
            >>> from torch import nn
            >>> from mixprec import Policy
            >>> Policy("nn.LayerNorm=fp32").module_rule(nn.LayerNorm(4), "norm")
            Rule('fp32')

        Host sync: none.
        """
        found = self.rule_source(module, name)
        return None if found is None else found[1]

    def rule_source(self, module: nn.Module, name: str | None) -> tuple[object, Rule] | None:
        """The key (a name glob or a class) and the rule :meth:`module_rule` finds, or None.

        Example:
            >>> from torch import nn
            >>> from mixprec import Policy
            >>> Policy("nn.LayerNorm=fp32").rule_source(nn.LayerNorm(4), "norm")[0].__name__
            'LayerNorm'

        Host sync: none.
        """
        return self.rule_for(module, () if name is None else (name,))

    def rule_for(self, module: nn.Module, names: Sequence[str]) -> tuple[object, Rule] | None:
        """The key and the rule of a module known under several ``names`` (one module object
        reached by several paths: ``nn.ModuleList([block] * 3)``, a module assigned to two
        parents): a name glob matching ANY of its names applies (for each name its first
        matching glob), else the nearest class rule.

        Example:
            >>> from torch import nn
            >>> from mixprec import Policy
            >>> Policy("h.1=fp32").rule_for(nn.Linear(2, 2), ["h.0", "h.1"])
            ('h.1', Rule('fp32'))

        Raises:
            ConfigError: two of its names take different rules (one module object has one
                rule); the message names them, the rules and the fix.

        Host sync: none.
        """
        found: list[tuple[str, str, Rule]] = []
        for name in names:
            for glob, rule in self._name_rules:
                if fnmatch.fnmatchcase(name, glob):
                    found.append((name, glob, rule))
                    break
        if found:
            if any(rule != found[0][2] for _, _, rule in found):
                raise disagreeing(names, found)
            return found[0][1], found[0][2]
        classes: dict[type, Rule] = self._class_rules
        if classes:
            for cls in type(module).__mro__:
                by_class = classes.get(cls)
                if by_class is not None:
                    return cls, by_class
        return None

    def with_matmuls(
        self, fprop: str | None = None, dgrad: str | None = None, wgrad: str | None = None
    ) -> Policy:
        """This policy with the given matmuls of every fp8-family module rule in other formats
        (a recipe word or ``"bf16"``, ``"fp16"``, ``"fp32"``; None keeps them): the late phase
        of training where the forward matmuls return to 16-bit is
        ``policy.with_matmuls(fprop="bf16")``. Other rules are kept as they are.

        Example:
            >>> from mixprec import Policy
            >>> str(Policy("nn.Linear=nvfp4, lm_head=bf16").with_matmuls(fprop="bf16"))
            'nn.Linear=bf16/nvfp4/nvfp4, lm_head=bf16'

        Raises:
            ConfigError: an unknown format, or a policy without an fp8-family rule (there is no
                matmul format to change: the result would be the same policy).

        Host sync: none.
        """
        if not any(rule.fp8_family for rule in self.modules.values()):
            raise ConfigError(
                f"policy {str(self)!r} has no fp8-family module rule: with_matmuls changes the "
                "formats of such rules' matmuls ('nn.Linear=nvfp4' -> 'nn.Linear=bf16/nvfp4/"
                "nvfp4'); give the modules a low-precision recipe first"
            )
        modules: dict[object, RuleLike] = {
            key: rule.with_matmuls(fprop, dgrad, wgrad) if rule.fp8_family else rule
            for key, rule in self.modules.items()
        }
        ops: dict[object, RuleLike] = {label: rule for label, rule in self.ops.items()}
        return Policy(modules=modules, ops=ops, strict=self.strict)

    def resolve(self, model: nn.Module) -> dict[str, Rule]:
        """Resolve the module rules over ``model.named_modules()`` (the static view): each
        module by its first name in torch's order, with the rule its names take
        (:meth:`rule_for`; a module reachable under several names answers to each of them).

        Example:
            >>> from torch import nn
            >>> from mixprec import Policy
            >>> m = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
            >>> Policy(modules={"0": "keep", nn.LayerNorm: "fp32"}).resolve(m)
            {'0': Rule('keep'), '1': Rule('fp32')}

        Raises:
            ConfigError: with ``strict``, a name glob matches no module of ``model``; the message
                lists the module names. Two names of one module take different rules.

        Host sync: none.
        """
        places = module_places(model)
        if self.strict:
            names = [n for _, every in places.values() for n in every]
            error = self._unmatched_error(names, "of the model")
            if error is not None:
                raise error
        found = {every[0]: self.rule_for(mod, every) for mod, every in places.values()}
        return {name: rule_source[1] for name, rule_source in found.items() if rule_source}

    def _unmatched_error(self, names: list[str], where: str) -> ConfigError | None:
        """The error for name globs that match none of ``names`` (None when all match).

        ``where`` completes "matched no module ..." (``"of the model"``, ``"that ran in the
        region"``).

        Host sync: none.
        """
        globs = [g for g, _ in self._name_rules]
        missing = [g for g in globs if not any(fnmatch.fnmatchcase(n, g) for n in names)]
        if not missing:
            return None
        hints = "".join(unmatched_hint(g, names) for g in missing)
        if not hints:
            shown = ", ".join(repr(n) for n in names[:12] if n) or "(none)"
            more = f" and {len(names) - 12} more" if len(names) > 12 else ""
            hints = f" Module names: {shown}{more}."
        return ConfigError(
            f"module rule(s) {', '.join(map(repr, missing))} matched no module {where}.{hints} "
            "Names are relative to the outermost module called; pass Policy(..., strict=False) "
            "to allow unmatched rules."
        )

    # ------------------------------------------------------------------ value protocol
    def __str__(self) -> str:
        labels = [class_label(k) if isinstance(k, type) else k for k in self.modules]
        entries = [f"{t}={r}" for t, r in zip(labels, self.modules.values(), strict=True)]
        entries += [f"{label}={rule}" for label, rule in self.ops.items()]
        return ", ".join(entries)

    def __repr__(self) -> str:
        extra = "" if self.strict else ", strict=False"
        return f"Policy({str(self)!r}{extra})"

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Policy):
            return NotImplemented
        return self._hash == other._hash and self._key == other._key

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (dict(self.modules), dict(self.ops), self.strict))


def _rebuild(modules: dict[object, Rule], ops: dict[object, Rule], strict: bool) -> Policy:
    return Policy(modules=modules, ops=ops, strict=strict)


def _add_op(table: dict[str, OpRule], key: object, rule: Rule) -> None:
    name, label = resolve_op(key)
    if not rule.accepted_for("ops"):
        raise ConfigError(f"op rule {label}={rule}: accepted for ops: {accepted_compute('ops')}")
    old = table.get(name)
    if old is not None and old.rule != rule:
        raise ConfigError(
            f"conflicting op rules for {name!r}: {old.label}={old.rule} and {label}={rule} "
            "(ops are matched by their Python name)"
        )
    table[name] = OpRule(name, label, rule)


def _add_module(
    table: dict[type[nn.Module] | str, Rule],
    written: dict[type[nn.Module] | str, str],
    key: object,
    rule: Rule,
) -> None:
    target = resolve_module(key)
    if not rule.accepted_for("modules"):
        raise ConfigError(
            f"module rule {key!r}: {str(rule)!r} applies to ops only; module rules accept "
            f"{accepted_compute('modules')}"
        )
    fp8.check_class_rule(target, rule)
    label = key.strip() if isinstance(key, str) else class_label(target)  # type: ignore[arg-type]
    if isinstance(target, str):
        target = canonical_glob(target)
    old = table.get(target)
    if old is not None and old != rule:
        name = class_label(target) if isinstance(target, type) else repr(target)
        raise ConfigError(
            f"conflicting module rules for {name}: {written[target]}={old} and {label}={rule} "
            "(one rule per module class or name glob; remove one of them)"
        )
    table[target] = rule
    written.setdefault(target, label)


def canonical_glob(glob: str) -> str:
    """The same glob written so that the policy string reads it back as itself: a ``[`` that
    no ``]`` closes (a literal) as ``[[]``, and a comma, semicolon or newline outside a
    character class (entry separators) inside one of its own.

    Example:
        >>> canonical_glob("a[b"), canonical_glob("x,y"), canonical_glob("[0,1].fc")
        ('a[[]b', 'x[,]y', '[0,1].fc')

    Host sync: none.
    """
    out = []
    for _, token in glob_tokens(glob):
        out.append(f"[{token}]" if token in ("[", ",", ";", "\n") else token)
    return "".join(out)


_INTERNED: dict[Policy, Policy] = {}
_INTERN_LIMIT = 64


def intern_policy(policy: Policy) -> Policy:
    """Return one canonical instance among equal policies.

    The rule hooks compare policies by identity, so a loop that builds an equal ``Policy`` (or
    passes the same policy string) every step reuses the bindings made on the first step.
    Policies are immutable, so sharing one instance is safe.

    Example:
        >>> intern_policy(Policy("nn.Linear=fp32")) is intern_policy(Policy("nn.Linear=fp32"))
        True

    Host sync: none.
    """
    found = _INTERNED.get(policy)
    if found is not None:
        return found
    if len(_INTERNED) >= _INTERN_LIMIT:
        _INTERNED.pop(next(iter(_INTERNED)))
    _INTERNED[policy] = policy
    return policy


@functools.lru_cache(maxsize=64)
def _policy_of_string(spec: str) -> Policy:
    return Policy(spec)  # interned at each use: the intern table may have dropped it since


def coerce_policy(policy: object) -> Policy | None:
    """A region's or table's ``policy`` argument as one canonical :class:`Policy` (or None).

    Example:
        >>> coerce_policy("nn.Linear=fp32") is coerce_policy(Policy("nn.Linear=fp32"))
        True

    Raises:
        ConfigError: ``policy`` is neither a Policy, a policy string nor None.

    Host sync: none.
    """
    if policy is None:
        return None
    if isinstance(policy, Policy):
        return intern_policy(policy)
    if isinstance(policy, str):
        return intern_policy(_policy_of_string(policy))
    raise ConfigError(
        f"policy must be a mixprec.Policy, a policy string or None, got {type(policy).__name__}"
    )


# ---------------------------------------------------------------- the static view
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
