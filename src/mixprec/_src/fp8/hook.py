"""What a policy rule calls: run the matmuls of the served modules in fp8 while a forward runs.

The caller (the autocast module-rule hooks) enters :func:`enter_modules` (one module's own rule,
or the Linear modules under a container's rule; :func:`enter_module` for one) before the forward
and :func:`exit_module` after it. In between, a narrowly scoped ``TorchFunctionMode`` replaces the
``F.linear`` calls on the served modules' weights with :func:`fp8_linear`; every other call
passes through. The mode traces under ``torch.compile`` (no graph break) and is re-entered by
the same hooks when ``torch.utils.checkpoint`` recomputes the module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._compile import _disable_dynamo
from torch.nn.utils import parametrize
from torch.overrides import TorchFunctionMode

from mixprec._src.fp8.matmul import Plan, fp8_linear, use_scaled_mm
from mixprec._src.fp8.recipes import Recipe
from mixprec._src.fp8.stats import active_stats
from mixprec.errors import ConfigError

SERVES = "nn.Linear and its subclasses (modules whose forward calls F.linear on self.weight)"


def can_serve(module_type: type) -> bool:
    """Whether an fp8 rule can run modules of this type in fp8.

    Example:
        >>> can_serve(nn.Linear), can_serve(nn.Conv2d)
        (True, False)

    Host sync: none.
    """
    return isinstance(module_type, type) and issubclass(module_type, nn.Linear)


class Fp8LinearMode(TorchFunctionMode):
    """Routes ``F.linear(x, weight, bias)`` on the given weights to the fp8 Linear, each with
    its own plan; every other call passes through.

    Example:
        >>> from mixprec._src.fp8.recipes import get_recipe
        >>> lin = nn.Linear(4, 3)
        >>> plan = Plan(get_recipe("rowwise"), torch.float32, scaled_mm=False)
        >>> with Fp8LinearMode(((lin.weight, plan),)):
        ...     y = lin(torch.randn(2, 4))
        >>> y.grad_fn.name()
        'AddBackward0'

    Host sync: none.
    """

    def __init__(self, served: tuple[tuple[torch.Tensor, Plan], ...], cache: Any = None) -> None:
        super().__init__()
        self.served = served  # compared with ``is``: traceable, and tied weights need no care
        self.cache = cache  # parametrize's cache, open while a parametrized weight is served

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            for served, plan in self.served:
                if weight is served:
                    bias = args[2] if len(args) > 2 else kwargs.get("bias")
                    x = args[0] if args else kwargs["input"]
                    return fp8_linear(x, weight, bias, plan)
        return func(*args, **kwargs)


def enter_module(
    module: nn.Module, name: str | None, recipe: Recipe, hp: torch.dtype
) -> Fp8LinearMode | None:
    """Start running ``module``'s own matmul in fp8 (the rest stays as it was); None if it has
    no weight to serve. ``hp`` is the high-precision dtype around the matmuls. While an
    :class:`~mixprec.Fp8Stats` is entered, the module's casts are recorded under ``name``.

    Example:
        >>> from mixprec._src.fp8.recipes import get_recipe
        >>> lin = nn.Linear(4, 3)
        >>> token = enter_module(lin, "lin", get_recipe("tensorwise"), torch.float32)
        >>> y = lin(torch.randn(2, 4)); exit_module(token)

    Host sync: none.
    """
    return enter_modules(((name or "", module),), recipe, hp)


def enter_modules(
    targets: Sequence[tuple[str, nn.Module]], recipe: Recipe, hp: torch.dtype
) -> Fp8LinearMode | None:
    """Start running the matmuls of several modules in fp8, each recorded under its own name
    (what a rule on a container does for the Linear modules inside it); None if none of them
    has a weight to serve.

    Example:
        >>> from mixprec._src.fp8.recipes import get_recipe
        >>> net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> targets = [("0", net[0]), ("2", net[2])]
        >>> token = enter_modules(targets, get_recipe("rowwise"), torch.float32)
        >>> y = net(torch.randn(2, 4)); exit_module(token)

    Host sync: none.
    """
    stats = active_stats()
    if stats is not None and torch.compiler.is_compiling():
        _refuse_stats_while_compiling()
    served: list[tuple[torch.Tensor, Plan]] = []
    cache = None
    for name, module in targets:
        if parametrize.is_parametrized(module, "weight"):
            # Recomputed at each access: computed here with parametrize's cache open, the
            # forward's F.linear receives this very tensor (its gradient flows to the
            # parametrization's parameters).
            if torch.compiler.is_compiling():
                _refuse_parametrized_while_compiling(name)
            cache = cache or _ParametrizeCache()
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            check_shape(name, tuple(weight.shape), recipe)
            slot = None if stats is None else stats.slot(name, weight.device, recipe.name)
            fast = use_scaled_mm(weight.device, recipe)
            served.append((weight, Plan(recipe, hp, fast, slot, name)))
    if not served:
        if cache is not None:
            cache.close()
        return None
    mode = Fp8LinearMode(tuple(served), cache)
    mode.__enter__()
    return mode


class _ParametrizeCache:
    """``torch.nn.utils.parametrize.cached()`` opened in one hook and closed in another (the
    same two steps as the context manager, which torch.compile cannot trace across hooks)."""

    def __init__(self) -> None:
        parametrize._cache_enabled += 1

    def close(self) -> None:
        parametrize._cache_enabled -= 1
        if not parametrize._cache_enabled:
            parametrize._cache = {}


def fits(shape: tuple[int, ...], recipe: Recipe) -> bool:
    """Whether ``recipe``'s blocks tile a Linear weight of ``shape`` (out, in) (what
    :func:`check_shape` refuses otherwise).

    Example:
        >>> from mixprec._src.fp8.recipes import get_recipe
        >>> mx = get_recipe("mxfp8")
        >>> fits((64, 96), mx), fits((8, 96), mx)
        (True, False)

    Host sync: none.
    """
    _, k, n = recipe.multiples()
    return len(shape) == 2 and shape[1] % k == 0 and shape[0] % n == 0


def check_shape(name: str, shape: tuple[int, ...], recipe: Recipe) -> None:
    """Refuse a Linear whose features the recipe's blocks do not tile (the tokens are padded).

    Example:
        >>> from mixprec._src.fp8.recipes import get_recipe
        >>> check_shape("fc", (64, 96), get_recipe("mxfp8"))
        >>> check_shape("fc", (64, 100), get_recipe("mxfp8"))
        Traceback (most recent call last):
        ...
        mixprec.errors.ConfigError: Linear 'fc' (in_features=100, out_features=64) cannot run ...

    Raises:
        ConfigError: names the module, its features and what they must be multiples of.

    Host sync: none.
    """
    if fits(shape, recipe):
        return
    _, k, n = recipe.multiples()
    raise ConfigError(
        f"Linear {name!r} (in_features={shape[-1]}, out_features={shape[0]}) cannot run "
        f"recipe {recipe.name!r}: its blocks need in_features a multiple of {k} and "
        f"out_features a multiple of {n}. Keep this module in bf16 (a rule such as "
        f"'{name or '<module>'}=bf16') or pad its features."
    )


_STATS_COMPILE_MSG = (
    "mixprec.Fp8Stats cannot record inside a torch.compile'd model (a compiled backward cannot "
    "update its buffers); enter it around an eager forward of the same model (it shares the "
    "parameters), e.g. one step in a hundred, and keep the compiled model for the others"
)


@_disable_dynamo
def _refuse_stats_while_compiling() -> None:
    # Dynamo runs this eagerly (a graph break), so the error reaches the user.
    raise ConfigError(_STATS_COMPILE_MSG)


@_disable_dynamo
def _refuse_parametrized_while_compiling(name: str) -> None:
    # Traced, reading the weight here calls the parametrization's modules inside this hook,
    # which dynamo does not follow reliably: refuse rather than risk a module run without fp8.
    raise ConfigError(
        f"an fp8-family rule reaches the parametrized Linear {name!r} (its weight is "
        "recomputed at each access, e.g. weight_norm) inside a torch.compile'd model, where "
        "mixprec cannot serve it: run that module eagerly, give it a rule of its own that is "
        f"not fp8 (e.g. '{name or '<module>'}=bf16'), or remove the parametrization "
        "(torch.nn.utils.parametrize.remove_parametrizations) before compiling"
    )


def exit_module(token: Fp8LinearMode | None) -> None:
    """Undo :func:`enter_module` or :func:`enter_modules`. Host sync: none."""
    if token is not None:
        token.__exit__(None, None, None)
        if token.cache is not None:
            token.cache.close()
