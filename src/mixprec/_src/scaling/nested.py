"""``scale()`` of nested outputs. Lists, tuples and dicts keep their type, as in torch; a subclass
is rebuilt from the scaled values (a named tuple from its fields, a ``defaultdict`` with its
factory, a mapping positionally or by keyword) and kept only if it is of the same type and holds
exactly those values; any other iterable comes back as a list; the rest is refused (ConfigError).
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from mixprec.errors import ConfigError

ScaleOn = Callable[[torch.device], torch.Tensor]


def scale_nested(value: Any, scale_on: ScaleOn) -> Any:
    """``value`` with every tensor multiplied by ``scale_on(tensor.device)``. Host sync: none."""
    if isinstance(value, torch.Tensor):
        return value * scale_on(value.device)
    if isinstance(value, Mapping):
        return _rebuild_mapping(value, {k: scale_nested(v, scale_on) for k, v in value.items()})
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ConfigError(
            "outputs must be a Tensor or an iterable of Tensors; found a "
            f"{type(value).__name__} ({value!r:.60}). Scale the loss tensor itself, e.g. "
            "scaler.scale(loss).backward()."
        )
    scaled = [scale_nested(v, scale_on) for v in value]
    kind: Any = type(value)
    if kind is list or kind is tuple:
        return kind(scaled)
    if isinstance(value, (list, tuple)):  # a subclass: kept if its constructor gives it back
        named = isinstance(value, tuple) and hasattr(value, "_fields")
        attempt = (lambda: kind(*scaled)) if named else (lambda: kind(scaled))
        rebuilt = _first_that_holds([attempt], lambda r: _holds_items(r, kind, scaled))
        if rebuilt is None:
            form = f"{kind.__name__}(*values)" if named else f"{kind.__name__}(list)"
            raise ConfigError(_cannot_rebuild(kind, f"{form} does not give"))
        return rebuilt
    return scaled


def _rebuild_mapping(value: Mapping[Any, Any], scaled: dict[Any, Any]) -> Mapping[Any, Any]:
    kind: Any = type(value)
    if kind is dict:
        return scaled
    if kind is OrderedDict:
        return OrderedDict(scaled)
    if isinstance(value, defaultdict):  # its factory first, also for subclasses
        attempts: list[Callable[[], Any]] = [lambda: kind(value.default_factory, scaled)]
    else:
        attempts = [lambda: kind(scaled)]
    if all(isinstance(k, str) for k in scaled):
        attempts.append(lambda: kind(**scaled))
    rebuilt = _first_that_holds(attempts, lambda r: _holds(r, kind, scaled))
    if rebuilt is None:
        forms = f"neither {kind.__name__}(dict) nor {kind.__name__}(**dict) gives"
        raise ConfigError(
            _cannot_rebuild(kind, forms) + " Or scale the tensors yourself: "
            "{k: scaler.scale(v) for k, v in outputs.items()}."
        )
    if isinstance(value, defaultdict) and rebuilt.default_factory is not value.default_factory:
        rebuilt.default_factory = value.default_factory
    return rebuilt


def _first_that_holds(attempts: list[Callable[[], Any]], holds: Callable[[Any], bool]) -> Any:
    for attempt in attempts:
        try:
            rebuilt = attempt()
        except Exception:  # a constructor of another shape: try the next form
            continue
        if holds(rebuilt):
            return rebuilt
    return None


def _cannot_rebuild(kind: type, forms: str) -> str:
    return (
        f"scale() cannot rebuild a {kind.__name__} from its scaled values: {forms} back the "
        "same type holding exactly those values. Pass a dict, a list or a tuple."
    )


def _holds_items(rebuilt: Any, kind: Any, scaled: list[Any]) -> bool:
    try:
        return (
            type(rebuilt) is kind
            and len(rebuilt) == len(scaled)
            and all(a is b for a, b in zip(rebuilt, scaled, strict=True))
        )
    except Exception:  # a sequence that cannot even be read back
        return False


def _holds(rebuilt: Any, kind: Any, scaled: dict[Any, Any]) -> bool:
    try:
        return (
            type(rebuilt) is kind
            and list(rebuilt.keys()) == list(scaled)
            and all(rebuilt[k] is v for k, v in scaled.items())
        )
    except Exception:  # a mapping that cannot even be read back
        return False
