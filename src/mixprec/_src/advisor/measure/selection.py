"""Which modules the advisor measures."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from torch import nn
from torch.nn.utils import parametrize

from mixprec.errors import ConfigError

# Modules that autocast already runs in float32 or that do no arithmetic worth lowering: they
# are left out of the default selection (name them in ``modules=`` to measure them anyway).
_SKIPPED: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.Embedding,
    nn.EmbeddingBag,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)


def select(model: nn.Module, spec: Sequence[object] | None) -> list[tuple[str, nn.Module]]:
    """The modules to measure: ``spec`` entries are name globs or nn.Module classes.

    By default: every leaf module that owns a parameter requiring grad, except normalization
    layers and embeddings; an ``nn.MultiheadAttention`` (its projections are not called as
    modules) and a parametrized module (``weight_norm``: its weight lives in a child) count as
    one module each.

    Raises:
        ConfigError: an entry matches nothing (the message lists the names), an entry of
            another type, the root module, or two selected modules nested in one another.
    """
    named = [(n, m) for n, m in model.named_modules() if n]
    if spec is None:
        chosen = _defaults(named)
        if not chosen:
            raise ConfigError(
                "the model has no leaf module with trainable parameters to measure (norms and "
                "embeddings are skipped by default); name the modules with modules=[...]"
            )
        return chosen
    if isinstance(spec, (str, type)):
        spec = [spec]
    picked: dict[str, nn.Module] = {}
    for entry in spec:
        matches = _matches(named, entry)
        if not matches:
            shown = ", ".join(repr(n) for n, _ in named[:30])
            more = f" and {len(named) - 30} more" if len(named) > 30 else ""
            raise ConfigError(
                f"modules entry {entry!r} matches no submodule of the model; names: {shown}{more}"
            )
        picked.update(matches)
    chosen = [(n, m) for n, m in named if n in picked]
    _check_disjoint([n for n, _ in chosen])
    return chosen


def _defaults(named: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    chosen: list[tuple[str, nn.Module]] = []
    units: set[str] = set()
    for name, module in named:
        parts = name.split(".")
        inside = any(".".join(parts[:i]) in units for i in range(1, len(parts)))
        if inside or isinstance(module, _SKIPPED):
            continue
        trainable = any(p.requires_grad for p in module.parameters())
        unit = isinstance(module, nn.MultiheadAttention) or parametrize.is_parametrized(module)
        leaf = next(module.children(), None) is None
        own = any(p.requires_grad for p in module.parameters(recurse=False))
        if (unit and trainable) or (leaf and own):
            chosen.append((name, module))
            units.add(name)
    return chosen


def _matches(named: list[tuple[str, nn.Module]], entry: object) -> list[tuple[str, nn.Module]]:
    if isinstance(entry, str):
        glob = entry.strip()
        if not glob:
            raise ConfigError("modules entry '' names the root module; name its submodules")
        return [(n, m) for n, m in named if fnmatch.fnmatchcase(n, glob)]
    if isinstance(entry, type) and issubclass(entry, nn.Module):
        return [(n, m) for n, m in named if isinstance(m, entry)]
    raise ConfigError(
        f"modules entry {entry!r} has type {type(entry).__name__}; entries are qualified-name "
        "globs ('blocks.*.mlp.fc2') or nn.Module classes (nn.Linear)"
    )


def _check_disjoint(names: list[str]) -> None:
    for outer in names:
        inner = next((n for n in names if n.startswith(outer + ".")), None)
        if inner is not None:
            raise ConfigError(
                f"modules {outer!r} and {inner!r} are both selected, but one contains the "
                "other; a rule on a module covers its children, so select one of them"
            )
