"""Policy targets: which module class, name glob or torch function a rule key names.

One resolver for every way a target is written (a class, a function, ``"nn.LayerNorm"``,
``"torch.nn.functional.softmax"``, ``"aten::gelu"``, a glob), shared by the string form and the
``modules=``/``ops=`` mappings, so the same words mean the same thing everywhere and a target
given in the wrong place is refused with a message saying where it goes.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from mixprec._src.autocast.rules import Rule
from mixprec._src.torch_compat import aten_op, has_public_attr, public_attr
from mixprec.errors import ConfigError

_NAMESPACES: tuple[tuple[str, Any], ...] = (
    ("F", torch.nn.functional),
    ("torch", torch),
    ("Tensor", torch.Tensor),
    ("torch.linalg", torch.linalg),
    ("torch.special", torch.special),
    ("torch.fft", torch.fft),
)
# Roots of the dotted names a policy string may use for torch classes and functions.
_ROOTS: dict[str, Any] = {
    "torch": torch,
    "nn": nn,
    "F": torch.nn.functional,
    "Tensor": torch.Tensor,
}
_OP_FORMS = (
    "a torch function (torch.matmul, torch.nn.functional.softmax, torch.Tensor.softmax, ...), "
    "or a string 'aten::gelu', 'F.softmax', 'torch.nn.functional.softmax', 'Tensor.softmax'"
)
_MODULE_FORMS = (
    "an nn.Module subclass (nn.LayerNorm, or the string 'nn.LayerNorm'; a class outside torch.nn "
    "as 'package.module:ClassName', e.g. 'transformers.pytorch_utils:Conv1D'), or a "
    "qualified-name glob string ('encoder.*.attn')"
)
# A class outside torch.nn, written as its module and qualified name ("pkg.mod:Outer.Inner").
_IMPORTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_][\w.<>]*")


@functools.cache
def python_op_names() -> frozenset[str]:
    names: set[str] = set()
    for _, ns in _NAMESPACES:
        names.update(n for n in dir(ns) if not n.startswith("__") and callable(getattr(ns, n)))
    return frozenset(names)


class OpRule(NamedTuple):
    """An op rule after validation: the Python name it matches, how it was written, its rule.

    Example:
        >>> import torch
        >>> from mixprec import Policy
        >>> Policy(ops={torch.matmul: "fp32"}).op_rules[0].name
        'matmul'

    Host sync: none.
    """

    name: str
    label: str
    rule: Rule

    def __repr__(self) -> str:
        return f"OpRule({self.label}={self.rule})"


def _unknown_op(text: str) -> ConfigError:
    close = difflib.get_close_matches(text.split("::")[-1].split(".")[-1], python_op_names(), 5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return ConfigError(f"op rule names an unknown op {text!r}{hint}. Accepted: {_OP_FORMS}")


def _unknown_class(text: str) -> ConfigError:
    classes = [n for n in dir(nn) if _is_module_class(public_attr(nn, n, None))]
    close = difflib.get_close_matches(text.rpartition(".")[2], classes, 3)
    hint = f"; did you mean {', '.join('nn.' + c for c in close)}?" if close else ""
    hint += outside_hint(text.rpartition(".")[2])
    return ConfigError(
        f"module rule names {text!r}, which is not an nn.Module class in torch.nn{hint} "
        f"Accepted: {_MODULE_FORMS}. For a submodule named like that, write the name as a glob "
        f"that is no torch name, e.g. '[{text[0]}]{text[1:]}'"
    )


def _instance_key(key: nn.Module, where: str) -> ConfigError:
    return ConfigError(
        f"{where} key {type(key).__name__}(...) is an nn.Module instance ({type(key).__name__}); "
        "a policy names modules by qualified name, as model.named_modules() lists them "
        f"(e.g. 'lm_head'), or by class ({class_label(type(key))}), and holds no model"
    )


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


def _lookup_dotted(text: str) -> object:
    """The torch object a dotted name (``nn.LayerNorm``, ``torch.nn.functional.softmax``) names,
    or None when the name does not start with a torch root or names nothing."""
    root, _, rest = text.partition(".")
    obj = _ROOTS.get(root)
    if obj is None or not rest:
        return None
    for part in rest.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def spelled_op(name: str) -> str:
    """How to write the op rule for a Python op name (``"softmax"`` -> ``"F.softmax"``)."""
    for prefix, ns in _NAMESPACES:
        if callable(getattr(ns, name, None)):
            return f"{prefix}.{name}"
    return f"torch.{name}"


def _is_module_class(obj: object) -> bool:
    return isinstance(obj, type) and issubclass(obj, nn.Module)


def outside_hint(word: str) -> str:
    """How to write the loaded ``nn.Module`` classes outside torch.nn whose name is ``word``
    (``"Conv1D"`` -> ``" For the class write 'transformers.pytorch_utils:Conv1D'."``), or "".

    Example:
        >>> outside_hint("NoSuchClassAnywhere")
        ''

    Host sync: none.
    """
    found, todo, seen = [], list(nn.Module.__subclasses__()), set()
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        todo.extend(cls.__subclasses__())
        label = class_label(cls)
        if cls.__name__ == word and label.startswith("nn.") is False and "<" not in label:
            found.append(label)
    if not found:
        return ""
    return f" For the class write {' or '.join(map(repr, sorted(found)))} (module:ClassName)."


def _import_class(text: str) -> type[nn.Module]:
    """The class ``"pkg.mod:Outer.Inner"`` names, imported; a ConfigError with the fix."""
    module_name, _, qualname = text.partition(":")
    fix = (
        "Name a class outside torch.nn as 'package.module:ClassName' (its __module__ and "
        "__qualname__) from an importable module, or pass the class itself in modules={cls: "
        f"...}}; for a submodule whose name holds ':', write it as a glob "
        f"({text.replace(':', '[:]')!r})"
    )
    if "<locals>" in qualname:
        raise ConfigError(
            f"module rule {text!r} names a class defined inside a function, which cannot be "
            f"imported back. Define it at module level. {fix}"
        )
    try:
        obj: object = importlib.import_module(module_name)
    except Exception as err:
        raise ConfigError(
            f"module rule {text!r}: cannot import {module_name!r} ({err}). {fix}"
        ) from err
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if not _is_module_class(obj):
        raise ConfigError(
            f"module rule {text!r}: {module_name!r} has no nn.Module class {qualname!r}."
            f"{outside_hint(qualname.rpartition('.')[2])} {fix}"
        )
    return obj  # type: ignore[return-value]


@functools.lru_cache(maxsize=512)
def _resolve_string(text: str) -> tuple[str, object]:
    """Classify one target string: ``("op", (name, label))``, ``("class", cls)`` or
    ``("glob", text)``; raise for a torch name that is neither a class nor a function."""
    if text.startswith("aten::"):
        base = text[len("aten::") :].split(".", 1)[0]
        if not base or aten_op(base) is None:
            raise _unknown_op(text)
        if base not in python_op_names():
            raise ConfigError(
                f"op rule {text!r}: aten::{base} exists but has no public Python function "
                f"mixprec can intercept; name the public function instead. Accepted: {_OP_FORMS}"
            )
        return "op", (base, f"aten::{base}")
    if _IMPORTED.fullmatch(text):
        return "class", _import_class(text)
    root, _, rest = text.partition(".")
    if root not in _ROOTS or not rest or any(c in text for c in "*?["):
        return "glob", text  # no torch name has glob characters
    obj = _lookup_dotted(text)
    if _is_module_class(obj):
        return "class", obj
    if callable(obj) and not isinstance(obj, type):
        return "op", _label_of_callable(obj)
    first = rest.split(".")[0]
    if obj is None and root == "nn" and not has_public_attr(nn, first) and not first[:1].isupper():
        return "glob", text  # a submodule called nn (torch_geometric's GINConv: "nn.0")
    if text.startswith(("nn.", "torch.nn.")) and obj is None:
        raise _unknown_class(text)
    if obj is None:
        raise _unknown_op(text)
    raise ConfigError(
        f"{text!r} names a {type(obj).__name__}, neither an nn.Module class nor a torch "
        f"function. Module rules accept {_MODULE_FORMS}; op rules accept {_OP_FORMS}"
    )


def resolve_op(key: object) -> tuple[str, str]:
    """``(python name, label)`` of an op rule key, or a ConfigError that says how to write it.

    Example:
        >>> resolve_op("torch.nn.functional.softmax"), resolve_op(torch.Tensor.exp)
        (('softmax', 'F.softmax'), ('exp', 'Tensor.exp'))

    Host sync: none.
    """
    if isinstance(key, str):
        kind, value = _resolve_string(key.strip())
        if kind == "op":
            return value  # type: ignore[return-value]
        if kind == "class":
            raise ConfigError(
                f"op rule {key!r} names a module class; module rules go in "
                f"modules={{{key!r}: ...}} (or the string form '{key}=rule')"
            )
        raise _unknown_op(key)
    if _is_module_class(key):
        raise ConfigError(
            f"op rule key {key!r} is a module class; module rules go in modules={{...}}"
        )
    if isinstance(key, nn.Module):
        raise _instance_key(key, "op rule")
    if callable(key):
        return _label_of_callable(key)
    raise ConfigError(f"op rule key {key!r} has type {type(key).__name__}. Accepted: {_OP_FORMS}")


def resolve_module(key: object) -> type[nn.Module] | str:
    """A module rule key as a class or a glob, or a ConfigError that says how to write it.

    Example:
        >>> resolve_module("torch.nn.LayerNorm"), resolve_module("encoder.*.attn")
        (<class 'torch.nn.modules.normalization.LayerNorm'>, 'encoder.*.attn')

    Host sync: none.
    """
    if _is_module_class(key):
        return key  # type: ignore[return-value]
    if isinstance(key, nn.Module):
        raise _instance_key(key, "module rule")
    if isinstance(key, str) and key.strip():
        kind, value = _resolve_string(key.strip())
        if kind == "op":
            raise ConfigError(
                f"module rule {key!r} names a function, not a module; op rules go in "
                f"ops={{{key!r}: ...}} (the string form '{key}=rule' is read as an op rule)"
            )
        return value  # type: ignore[return-value]
    if callable(key) and not isinstance(key, type):
        raise ConfigError(
            f"module rule key {key!r} is a function; op rules go in ops={{...}}. "
            f"Module rules accept {_MODULE_FORMS}"
        )
    raise ConfigError(f"module rule key {key!r} is not accepted. Accepted: {_MODULE_FORMS}")


@functools.lru_cache(maxsize=128)
def parse_spec(spec: str) -> tuple[tuple[bool, object, Rule], ...]:
    """Parse ``"nn.LayerNorm=fp32, encoder.*.attn=bf16, F.gelu=low@input"`` into
    ``(is_op, key, rule)`` entries; function names are op rules, classes and globs module rules."""
    entries: list[tuple[bool, object, Rule]] = []
    for raw in split_entries(spec):
        item = raw.strip()
        if not item:
            continue
        target, sep, rule_text = item.rpartition("=")
        target = target.strip()
        if not sep or not target:
            raise ConfigError(
                f"policy entry {item!r} is not 'target=rule'; example: "
                "'nn.LayerNorm=fp32, encoder.*.attn=bf16, router=keep, F.gelu=low@input'"
            )
        kind, _ = _resolve_string(target)  # refuses a torch name that is neither
        entries.append((kind == "op", target, Rule(rule_text)))
    return tuple(entries)


def split_entries(spec: str) -> list[str]:
    """Split a policy string at commas, semicolons and newlines outside a glob's character
    classes (``blocks.[0,1].fc`` may hold commas), read as ``fnmatch`` reads them."""
    parts: list[str] = []
    start = 0
    for i, token in glob_tokens(spec):
        if token in (",", ";", "\n"):
            parts.append(spec[start:i])
            start = i + 1
    parts.append(spec[start:])
    return parts


def glob_tokens(text: str) -> list[tuple[int, str]]:
    """``(position, token)`` of a glob as ``fnmatch`` reads it: a character class ``[...]``
    (``!`` or ``]`` first belong to it) is one token; a ``[`` that no ``]`` closes is a
    literal character.

    Example:
        >>> [t for _, t in glob_tokens("a[!]b],[c")]
        ['a', '[!]b]', ',', '[', 'c']

    Host sync: none.
    """
    tokens, i, n = [], 0, len(text)
    while i < n:
        j = i + 1
        if text[i] == "[":
            j += text[j : j + 1] == "!"
            j += text[j : j + 1] == "]"
            close = text.find("]", j)
            j = i + 1 if close < 0 else close + 1
        tokens.append((i, text[i:j]))
        i = j
    return tokens


def class_label(cls: type) -> str:
    """How a policy string names a class: ``nn.X`` for torch.nn's, else ``module:Qualname``,
    which the policy string imports back.

    Example:
        >>> from torch.nn.modules.linear import NonDynamicallyQuantizableLinear as Packed
        >>> class_label(nn.Linear), class_label(Packed)
        ('nn.Linear', 'torch.nn.modules.linear:NonDynamicallyQuantizableLinear')

    Host sync: none.
    """
    if public_attr(nn, cls.__name__, None) is cls:
        return f"nn.{cls.__name__}"
    return f"{cls.__module__}:{cls.__qualname__}"


def unmatched_hint(glob: str, names: list[str]) -> str:
    """What a glob that matched nothing may have meant: close module names, a class outside
    torch.nn of that name, an op of that name; "" when nothing is close."""
    hint = ""
    close = difflib.get_close_matches(glob, [n for n in names if n], 3, 0.75)
    if close:
        hint += f" For {glob!r}, did you mean {', '.join(map(repr, close))}?"
    if glob.isidentifier():
        hint += outside_hint(glob)
        if glob in python_op_names():
            hint += f" {glob!r} is read as a module name; for the op write {spelled_op(glob)!r}."
    return hint


def module_places(root: nn.Module) -> dict[int, tuple[nn.Module, list[str]]]:
    """Each module of ``root`` (by id, in torch's ``named_modules`` order) with every name it is
    reachable under, torch's own (first) name first.

    Example:
        >>> from torch import nn
        >>> block = nn.Linear(2, 2)
        >>> [names for _, names in module_places(nn.Sequential(block, block)).values()]
        [[''], ['0', '1']]

    Host sync: none.
    """
    places: dict[int, tuple[nn.Module, list[str]]] = {}
    for name, mod in root.named_modules(remove_duplicate=False):
        places.setdefault(id(mod), (mod, []))[1].append(name)
    return places


def disagreeing(names: Sequence[str], found: list[tuple[str, str, Rule]]) -> ConfigError:
    taken = ", ".join(f"{name!r} takes {glob}={rule}" for name, glob, rule in found)
    return ConfigError(
        f"one module is reachable under the names {', '.join(map(repr, names))} and its "
        f"names take different rules: {taken}. One module object runs at each of its names "
        "(nn.ModuleList([block] * 3), a module assigned to two parents), so it has one rule: "
        "give its names one rule, or build separate modules (copy.deepcopy) to rule each "
        "place on its own"
    )
