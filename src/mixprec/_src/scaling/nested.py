"""``scale()`` of nested outputs: which containers are rebuilt, and how.

Tensors are multiplied by the scale on their own device. Lists and tuples keep their type (named
tuples too), as torch does; dicts (also ``OrderedDict`` and ``defaultdict``) keep theirs; another
mapping type is rebuilt from a dict of the scaled values, positionally or by keyword, and kept
only if the result holds exactly those values (a constructor with keyword fields would otherwise
put the whole dict in its first field). Any other iterable comes back as a list. What cannot be
rebuilt is refused with a :class:`~mixprec.errors.ConfigError` naming its type.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from mixprec.errors import ConfigError

ScaleOn = Callable[[torch.device], torch.Tensor]


def scale_nested(value: Any, scale_on: ScaleOn) -> Any:
    """``value`` with every tensor multiplied by ``scale_on(tensor.device)``.

    Raises:
        ConfigError: a leaf is not a tensor, or a mapping cannot be rebuilt.

    Host sync: none.
    """
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
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*scaled)
    if isinstance(value, (list, tuple)):
        return type(value)(scaled)
    return scaled


def _rebuild_mapping(value: Mapping[Any, Any], scaled: dict[Any, Any]) -> Mapping[Any, Any]:
    kind: Any = type(value)
    if kind is dict:
        return scaled
    if kind is OrderedDict:
        return OrderedDict(scaled)
    if kind is defaultdict:
        return defaultdict(value.default_factory, scaled)  # type: ignore[attr-defined]
    attempts: list[Callable[[], Any]] = [lambda: kind(scaled)]
    if all(isinstance(k, str) for k in scaled):
        attempts.append(lambda: kind(**scaled))
    for attempt in attempts:
        try:
            rebuilt = attempt()
        except Exception:  # a constructor of another shape: try the next form
            continue
        if _holds(rebuilt, kind, scaled):
            return rebuilt
    raise ConfigError(
        f"scale() cannot rebuild a {kind.__name__} from its scaled values (neither "
        f"{kind.__name__}(dict) nor {kind.__name__}(**dict) gives back the same keys and "
        "values). Pass a dict, or scale the tensors yourself: "
        "{k: scaler.scale(v) for k, v in outputs.items()}."
    )


def _holds(rebuilt: Any, kind: Any, scaled: dict[Any, Any]) -> bool:
    try:
        return (
            type(rebuilt) is kind
            and list(rebuilt.keys()) == list(scaled)
            and all(rebuilt[k] is v for k, v in scaled.items())
        )
    except Exception:  # a mapping that cannot even be read back
        return False
