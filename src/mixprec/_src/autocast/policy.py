"""``Policy``: per-module and per-op precision rules on top of native autocast."""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from mixprec._src.autocast.rules import Rule, RuleLike
from mixprec.errors import ConfigError

_NAMESPACES: tuple[tuple[str, Any], ...] = (
    ("F", torch.nn.functional),
    ("torch", torch),
    ("Tensor", torch.Tensor),
    ("torch.linalg", torch.linalg),
    ("torch.special", torch.special),
    ("torch.fft", torch.fft),
)
_OP_FORMS = (
    "a torch function (torch.matmul, torch.nn.functional.softmax, torch.Tensor.softmax, ...), "
    "or a string 'aten::gelu', 'F.softmax', 'torch.matmul', 'Tensor.softmax'"
)
_MODULE_FORMS = (
    "an nn.Module subclass (nn.LayerNorm), or a qualified-name glob string ('encoder.*.attn')"
)


def _python_op_names() -> set[str]:
    names: set[str] = set()
    for _, ns in _NAMESPACES:
        names.update(n for n in dir(ns) if not n.startswith("__") and callable(getattr(ns, n)))
    return names


class OpRule:
    """An op rule after validation: the Python name it matches, how it was written, its rule.

    Example:
        >>> import torch
        >>> from mixprec import Policy
        >>> Policy(ops={torch.matmul: "fp32"}).op_rules[0].name
        'matmul'

    Host sync: none.
    """

    __slots__ = ("label", "name", "rule")

    def __init__(self, name: str, label: str, rule: Rule) -> None:
        self.name = name
        self.label = label
        self.rule = rule

    def __repr__(self) -> str:
        return f"OpRule({self.label}={self.rule})"


def _unknown_op(text: str) -> ConfigError:
    close = difflib.get_close_matches(text.split("::")[-1].split(".")[-1], _python_op_names(), 5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return ConfigError(f"op rule names an unknown op {text!r}{hint}. Accepted: {_OP_FORMS}")


def _label_of_callable(fn: Callable[..., Any]) -> tuple[str, str]:
    name = getattr(fn, "__name__", None)
    if isinstance(name, str):
        for prefix, ns in _NAMESPACES:
            if getattr(ns, name, None) is fn:
                return name, f"{prefix}.{name}"
    raise ConfigError(
        f"op rule names {fn!r}, which is not a torch function mixprec can intercept. "
        f"Accepted: {_OP_FORMS}. For your own functions use mixprec.custom_fwd(cast_inputs=...)."
    )


def _resolve_op_string(text: str) -> tuple[str, str]:
    if text.startswith("aten::"):
        base = text[len("aten::") :].split(".", 1)[0]
        if not base or not hasattr(torch.ops.aten, base):
            raise _unknown_op(text)
        if base not in _python_op_names():
            raise ConfigError(
                f"op rule {text!r}: aten::{base} exists but has no public Python function "
                f"mixprec can intercept; name the public function instead. Accepted: {_OP_FORMS}"
            )
        return base, f"aten::{base}"
    for prefix, ns in _NAMESPACES:
        if text.startswith(prefix + ".") and "." not in text[len(prefix) + 1 :]:
            fn = getattr(ns, text[len(prefix) + 1 :], None)
            if callable(fn):
                return _label_of_callable(fn)
    raise _unknown_op(text)


def _resolve_op(key: object) -> tuple[str, str]:
    if isinstance(key, str):
        return _resolve_op_string(key.strip())
    if callable(key):
        return _label_of_callable(key)
    raise ConfigError(f"op rule key {key!r} has type {type(key).__name__}. Accepted: {_OP_FORMS}")


def _class_from_string(text: str) -> type[nn.Module] | None:
    for prefix in ("torch.nn.", "nn."):
        if text.startswith(prefix):
            obj = getattr(nn, text[len(prefix) :], None)
            if isinstance(obj, type) and issubclass(obj, nn.Module):
                return obj
            raise ConfigError(
                f"module rule names {text!r}, which is not an nn.Module class. Accepted: "
                f"{_MODULE_FORMS}"
            )
    return None


def _is_op_string(text: str) -> bool:
    return text.startswith(("aten::", "F.", "torch.", "Tensor."))


def _parse_spec(spec: str) -> list[tuple[bool, object, Rule]]:
    """Parse ``"nn.LayerNorm=fp32, encoder.*.attn=bf16, aten::gelu=low@input"``."""
    entries: list[tuple[bool, object, Rule]] = []
    for raw in spec.replace(";", ",").replace("\n", ",").split(","):
        item = raw.strip()
        if not item:
            continue
        target, sep, rule_text = item.rpartition("=")
        target = target.strip()
        if not sep or not target:
            raise ConfigError(
                f"policy entry {item!r} is not 'target=rule'; example: "
                "'nn.LayerNorm=fp32, encoder.*.attn=bf16, router=keep, aten::gelu=low@input'"
            )
        compute, _, output = rule_text.partition("@")
        rule = Rule(compute, output.strip() or None)
        cls = _class_from_string(target)
        if cls is not None:
            entries.append((False, cls, rule))
        else:
            entries.append((_is_op_string(target), target, rule))
    return entries


class Policy:
    """Per-module and per-op precision rules for :class:`mixprec.autocast`.

    Module rules (by ``nn.Module`` class or qualified-name glob, ``*`` matching any characters
    including dots; names are relative to the root module called in the region) apply to every
    module that runs inside the region, with its whole subtree. Op rules (by torch function or
    ``"aten::name"``) apply to calls of the public Python functions of that name (``torch.x``,
    ``torch.nn.functional.x``, ``Tensor.x``). Rules act only where native autocast is enabled for
    the region's device: a ``"fp32"`` or ``"keep"`` module is a closed island.

    Args:
        spec: optional short string form, entries ``target=rule[@output]`` separated by commas.
            ``nn.X`` targets are module classes; ``aten::x``, ``F.x``, ``torch.x``, ``Tensor.x``
            targets are ops; anything else is a qualified-name glob.
        modules: mapping of module class or name glob to a rule.
        ops: mapping of torch function or op string to a rule.
        strict: raise :class:`ConfigError` at the end of a region when a name glob matched no
            module that ran in it (catches typos).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import mixprec
        >>> p = mixprec.Policy(modules={nn.LayerNorm: "fp32"}, ops={"aten::gelu": "low"})
        >>> str(p)
        'nn.LayerNorm=fp32, aten::gelu=low'
        >>> mixprec.Policy(str(p)) == p
        True

    Raises:
        ConfigError: an unknown target, a non-Module class, an op that does not exist, a
            ``"promote"`` module rule, or conflicting rules for one op name.

    Host sync: none.
    """

    def __init__(
        self,
        spec: str | None = None,
        *,
        modules: Mapping[object, RuleLike] | None = None,
        ops: Mapping[object, RuleLike] | None = None,
        strict: bool = True,
    ) -> None:
        self._class_rules: dict[type[nn.Module], Rule] = {}
        self._name_rules: dict[str, Rule] = {}
        self._ops: dict[str, OpRule] = {}
        self.strict = bool(strict)
        if spec is not None and not isinstance(spec, str):
            raise ConfigError(f"Policy spec must be a string, got {type(spec).__name__}")
        for is_op, key, rule in _parse_spec(spec or ""):
            self._add(is_op, key, rule)
        for key, value in (modules or {}).items():
            self._add(False, key, Rule.coerce(value))
        for key, value in (ops or {}).items():
            self._add(True, key, Rule.coerce(value))
        self._op_rules = tuple(self._ops.values())  # read on hot paths: computed once
        self._op_table = {name: op.rule for name, op in self._ops.items()}

    def _add(self, is_op: bool, key: object, rule: Rule) -> None:
        if is_op:
            name, label = _resolve_op(key)
            old = self._ops.get(name)
            if old is not None and old.rule != rule:
                raise ConfigError(
                    f"conflicting op rules for {name!r}: {old.label}={old.rule} and "
                    f"{label}={rule} (ops are matched by their Python name)"
                )
            self._ops[name] = OpRule(name, label, rule)
            return
        if rule.compute == "promote":
            raise ConfigError(
                f"module rule {key!r}: 'promote' applies to ops only; module rules accept "
                "'fp32', 'low', 'keep' or a low-precision dtype"
            )
        if isinstance(key, type) and issubclass(key, nn.Module):
            self._class_rules[key] = rule
        elif isinstance(key, str) and key.strip() and not _is_op_string(key.strip()):
            self._name_rules[key.strip()] = rule
        else:
            raise ConfigError(f"module rule key {key!r} is not accepted. Accepted: {_MODULE_FORMS}")

    @property
    def has_module_rules(self) -> bool:
        """Whether any module rule exists. Host sync: none."""
        return bool(self._class_rules or self._name_rules)

    @property
    def op_rules(self) -> tuple[OpRule, ...]:
        """The op rules, in insertion order. Host sync: none."""
        return self._op_rules

    @property
    def op_table(self) -> dict[str, Rule]:
        """Python op name -> rule (what the op interceptor matches). Host sync: none."""
        return dict(self._op_table)

    @property
    def class_rules(self) -> dict[type[nn.Module], Rule]:
        """Module class -> rule. Host sync: none."""
        return dict(self._class_rules)

    @property
    def name_rules(self) -> dict[str, Rule]:
        """Qualified-name glob -> rule. Host sync: none."""
        return dict(self._name_rules)

    def module_rule(self, module: nn.Module, name: str | None) -> Rule | None:
        """The rule for one module: the first matching name glob, else the nearest class rule.

        Example:
            >>> from torch import nn
            >>> from mixprec import Policy
            >>> Policy("nn.LayerNorm=fp32").module_rule(nn.LayerNorm(4), "norm")
            Rule('fp32')

        Host sync: none.
        """
        if name is not None:
            for glob, rule in self._name_rules.items():
                if fnmatch.fnmatchcase(name, glob):
                    return rule
        if self._class_rules:
            for cls in type(module).__mro__:
                found = self._class_rules.get(cls)
                if found is not None:
                    return found
        return None

    def resolve(self, model: nn.Module) -> dict[str, Rule]:
        """Resolve the module rules over ``model.named_modules()`` (the static view).

        Example:
            >>> from torch import nn
            >>> from mixprec import Policy
            >>> m = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
            >>> Policy(modules={"0": "keep", nn.LayerNorm: "fp32"}).resolve(m)
            {'0': Rule('keep'), '1': Rule('fp32')}

        Raises:
            ConfigError: with ``strict``, a name glob matches no module; the message lists the
                module names.

        Host sync: none.
        """
        names = [name for name, _ in model.named_modules()]
        if self.strict:
            self.check_names(names, set(names))
        return {
            name: rule
            for name, mod in model.named_modules()
            if (rule := self.module_rule(mod, name)) is not None
        }

    def check_names(self, names: list[str], seen: set[str]) -> None:
        """Raise if a name glob matched none of ``seen``; ``names`` is listed in the message.

        Example:
            >>> from mixprec import Policy
            >>> Policy("enc.*=keep").check_names(["enc.0"], {"enc.0"})

        Host sync: none.
        """
        missing = [g for g in self._name_rules if not any(fnmatch.fnmatchcase(n, g) for n in seen)]
        if missing:
            shown = ", ".join(repr(n) for n in names[:40] if n) or "(none)"
            more = f" and {len(names) - 40} more" if len(names) > 40 else ""
            raise ConfigError(
                f"module rule(s) {', '.join(map(repr, missing))} matched no module that ran in "
                f"the region. Module names seen: {shown}{more}. Names are relative to the "
                "outermost module called; pass Policy(strict=False) to allow unmatched rules."
            )

    def _entries(self) -> list[str]:
        out = [f"{_class_label(c)}={r}" for c, r in self._class_rules.items()]
        out += [f"{g}={r}" for g, r in self._name_rules.items()]
        out += [f"{op.label}={op.rule}" for op in self._ops.values()]
        return out

    def __str__(self) -> str:
        return ", ".join(self._entries())

    def __repr__(self) -> str:
        return f"Policy({str(self)!r})"

    def _key(self) -> tuple[object, ...]:
        ops = tuple(sorted((n, o.rule.compute, o.rule.output) for n, o in self._ops.items()))
        return (
            tuple(self._class_rules.items()),
            tuple(self._name_rules.items()),
            repr(ops),
            self.strict,
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Policy) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


def _class_label(cls: type) -> str:
    if getattr(nn, cls.__name__, None) is cls:
        return f"nn.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


_INTERNED: dict[tuple[object, ...], Policy] = {}
_INTERN_LIMIT = 64


def intern_policy(policy: Policy) -> Policy:
    """Return the canonical instance among equal policies (the hooks compare policies by identity).

    A loop that builds an equal ``Policy`` (or passes the same policy string) every step then
    reuses the bindings made on the first step instead of redoing them.

    Example:
        >>> intern_policy(Policy("nn.Linear=fp32")) is intern_policy(Policy("nn.Linear=fp32"))
        True

    Host sync: none.
    """
    key = policy._key()
    found = _INTERNED.get(key)
    if found is None:
        if len(_INTERNED) >= _INTERN_LIMIT:
            _INTERNED.pop(next(iter(_INTERNED)))
        _INTERNED[key] = found = policy
    return found
