"""What an fp8-family rule does while a module's forward runs: serve the matmuls on its weights.

The caller (the autocast module hooks, or :func:`enter_module`) opens a :class:`Scope` per module
call and keeps one :class:`Fp8Mode` entered while any scope is open in the thread. The mode sees
every torch function call and follows the module's *parameters* and every tensor computed from
them and constants alone (a transposed, scaled, LoRA-merged or parametrized weight, whatever
matmuls computed it). A matmul that consumes such a weight (its other operand an activation), in
any spelling torch accepts (``F.linear``, ``@``, ``torch.matmul``, ``torch.linalg.matmul``,
``mm``, ``mv``, ``addmm``, ``addmv``, as functions or methods, with positional or keyword
arguments: bound by one table, ``OPS``), is rewritten as ``y = x @ W.T`` and handed to
:func:`serve_linear`, the one place where a weight operand meets the recipe's matmul; a matmul
computing a weight (both operands weights or constants) runs as written. Every other call passes
through. Which scope governs the call (its recipe, name and stats) is the innermost one, asked at
each call: a module with a rule of another kind inside a served one is not served. A matmul-like
op the recipe cannot run with a weight operand (``bmm``, ``einsum``, ``F.conv*``,
``tensordot``, ``linalg.vecdot``, the packed projections of ``F.multi_head_attention_forward``)
is refused whatever else the module served, and a guarded scope (a module the rule names, or a
Linear) that closes having served nothing is an error naming the module and what it called
(:func:`served_nothing`). The mode traces under ``torch.compile``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from mixprec._src.fp8.matmul import Plan, fp8_linear, use_scaled_mm
from mixprec._src.fp8.recipes import Recipe
from mixprec._src.fp8.spellings import OPS, PAIR, REFUSED, RMATMUL, SCALES, label
from mixprec._src.fp8.stats import Fp8Stats, active_stats
from mixprec._src.torch_compat import disable_dynamo
from mixprec.errors import ConfigError

SERVES = (
    "nn.Linear and every matmul a module's forward runs on its weights or on tensors computed "
    "from them (F.linear, @ / torch.matmul / torch.linalg.matmul, mm, mv, addmm, addmv)"
)


def can_serve(module_type: type) -> bool:
    """Whether an fp8 class rule may name this module type (every ``nn.Linear`` subclass, and
    every class outside torch.nn, whose forward the rule's guard checks at run time).

    Example:
        >>> can_serve(nn.Linear), can_serve(nn.Conv2d)
        (True, False)

    Host sync: none.
    """
    if not isinstance(module_type, type) or not issubclass(module_type, nn.Module):
        return False
    return issubclass(module_type, nn.Linear) or not module_type.__module__.startswith("torch.")


def computes_weight(name: str) -> bool:
    """Whether the module of qualified name ``name`` is one of torch's parametrizations (kept at
    ``<module>.parametrizations.<tensor>``, as ``register_parametrization`` documents): what its
    forward computes is a weight, never an activation.

    Example:
        >>> computes_weight("fc.parametrizations.weight.0"), computes_weight("fc")
        (True, False)

    Host sync: none.
    """
    return "parametrizations" in name.split(".")[:-1]


class Scope:
    """One module call served by a recipe: its name, the stats it records into, the module whose
    forward runs (its own weights are read again when a call misses them), and what it did (served
    matmuls, the calls that took one of its weights). Host sync: none."""

    __slots__ = (
        "called",
        "computing",
        "guarded",
        "hp",
        "label",
        "model",
        "module",
        "name",
        "recipe",
        "served",
        "stats",
    )

    def __init__(
        self,
        name: str,
        recipe: Recipe,
        hp: torch.dtype,
        stats: Fp8Stats | None,
        guarded: bool,
        model: object = None,
        module: nn.Module | None = None,
        label: str | None = None,
    ) -> None:
        self.name, self.recipe, self.hp, self.stats = name, recipe, hp, stats
        self.guarded, self.model, self.module = guarded, model, module
        self.label = recipe.name if label is None else label  # the recipe its stats record
        self.served = 0
        self.called: list[str] = []  # the functions that took one of its weights
        self.computing = computes_weight(name)  # whatever its matmuls take, they compute one

    def plan(self, device: torch.device) -> Plan:
        """The plan of one served matmul on ``device``. Host sync: none."""
        slot = None
        if self.stats is not None:
            slot = self.stats.slot(self.name, device, self.label, self.model)
        return Plan(self.recipe, self.hp, use_scaled_mm(device, self.recipe), slot, self.name)


def serve_linear(
    scope: Scope, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on the recipe of ``scope``: the one place where a ruled
    module's weight operand (``(out, in)``, whatever form the forward gave it) is handed to the
    recipe's matmul.

    Example:
        >>> from mixprec._src.fp8.recipes import get_recipe
        >>> s = Scope("fc", get_recipe("tensorwise"), torch.float32, None, True)
        >>> serve_linear(s, torch.ones(2, 4), torch.ones(3, 4), None).shape
        torch.Size([2, 3])

    Raises:
        ConfigError: the recipe's blocks do not tile the weight (names the module).

    Host sync: none.
    """
    if weight.dim() != 2:
        raise ConfigError(_unservable(scope.name, "a matmul", f"a {weight.dim()}-D weight"))
    check_shape(scope.name, tuple(weight.shape), scope.recipe)
    scope.served += 1
    if weight.numel() == 0:  # Linear(0, n) or Linear(n, 0): nothing to scale, zeros as nn.Linear
        with torch.autocast(x.device.type, enabled=False):
            out = x.to(scope.hp) @ weight.to(scope.hp).t()
            return out if bias is None else out + bias.to(scope.hp)
    return fp8_linear(x, weight, bias, scope.plan(weight.device))


class _Tensors:
    """A set of tensors compared with ``is``: by id in eager mode (one lookup per tensor), along
    the list while Dynamo traces (it does not trace ``id`` of a tensor); ``listed`` once anything
    was added while tracing (a graph break then runs the rest eagerly). A ``weak`` set holds what
    eager mode adds by weak reference (the constants: a causal mask made in each block is freed
    after its block, not kept until the outermost forward ends)."""

    __slots__ = ("added", "ids", "items", "listed", "weak")

    def __init__(self, weak: bool = False) -> None:
        self.items: list[torch.Tensor] = []
        self.ids: dict[int, Any] = {}  # the tensor, or a weak reference to it
        self.listed = self.added = False
        self.weak = weak

    def add(self, t: torch.Tensor) -> None:
        self.added = True
        if torch.compiler.is_compiling():
            self.items.append(t)
            self.listed = True
        elif self.weak:
            self.ids[id(t)] = weakref.ref(t)
        else:
            self.items.append(t)
            self.ids[id(t)] = t

    def __contains__(self, value: torch.Tensor) -> bool:
        if torch.compiler.is_compiling():
            return any(value is t for t in self.items)
        found = self.ids.get(id(value))
        if found is not None and (found() if self.weak else found) is value:
            return True
        return self.listed and any(value is t for t in self.items)


def _tensors_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    values = (*args, *kwargs.values())
    found = [v for v in values if isinstance(v, torch.Tensor)]
    seqs = (v for v in values if isinstance(v, (list, tuple)))
    return found + [t for v in seqs for t in v if isinstance(t, torch.Tensor)]


def _outputs(out: object) -> list[torch.Tensor]:
    items = out if isinstance(out, (list, tuple)) else (out,)
    return [t for t in items if isinstance(t, torch.Tensor)]


class Fp8Mode(TorchFunctionMode):
    """Serves the matmuls that consume followed tensors (parameters and what is computed from
    them) under the scope ``current()`` returns (None: pass through).

    Three kinds of tensors: *followed* (a weight, or computed from weights and constants alone),
    *constants* (made by a torch function that took no tensor, such as ``torch.eye`` in a
    parametrization, or computed from constants alone) and activations (the rest). A matmul
    with a followed operand and an activation consumes the weight: served. One on weights and
    constants computes a weight (an orthogonal parametrization's ``base @ Q``): not served, its
    result followed.

    Example:
        >>> from mixprec._src.fp8.recipes import get_recipe
        >>> lin, x = nn.Linear(4, 3), torch.randn(2, 4)
        >>> s = Scope("lin", get_recipe("rowwise"), torch.float32, None, True)
        >>> with Fp8Mode(list(lin.parameters()), lambda: s):
        ...     w = lin.weight @ torch.eye(4)  # computes a weight: not served
        ...     y = x @ w.t()  # consumes it: served
        >>> s.served
        1

    Host sync: none.
    """

    def __init__(
        self,
        followed: list[torch.Tensor],
        current: Callable[[], Scope | None],
        on_serve: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self.current = current
        self.on_serve = on_serve  # called after each served matmul (eager)
        self._followed_set = _Tensors()  # compared with ``is``: tied weights need no care
        self._constants = _Tensors(weak=True)
        self.follow(followed)

    @property
    def followed(self) -> list[torch.Tensor]:
        """The tensors followed so far (a checkpoint's recomputation follows them too). Host
        sync: none."""
        return self._followed_set.items

    def follow(self, tensors: Iterable[torch.Tensor]) -> None:
        """Follow these tensors too (the weights of a module whose scope opens). Host sync:
        none."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and not self._followed(t):
                self._followed_set.add(t)

    def follow_aliases(self, values: Iterable[object]) -> None:
        """Follow each tensor of ``values`` that is a followed tensor under another name: the
        same elements of the same memory (what ``detach()`` gives: a reentrant checkpoint's
        recomputation receives its arguments detached). Host sync: none."""
        for v in values:
            if not isinstance(v, torch.Tensor) or self._followed(v) or v.data_ptr() == 0:
                continue
            if any(_same_view(v, t) for t in self.followed):
                self._followed_set.add(v)

    def _followed(self, value: object) -> bool:
        if not isinstance(value, torch.Tensor):
            return False
        found = self._followed_set
        if found.listed or torch.compiler.is_compiling():
            if any(value is t for t in found.items):
                return True
        elif found.ids.get(id(value)) is value:  # (inline: the eager hot path)
            return True
        # A module hook that runs after mixprec's (FSDP2's unshard) may have swapped one of the
        # running module's own weights in since its scope opened: read them as it holds them.
        scope = self.current()
        module = None if scope is None else scope.module
        if module is None:
            return False
        own = (*module.parameters(recurse=False), *module.buffers(recurse=False))
        if any(value is t for t in own):
            self._followed_set.add(value)
            return True
        return False

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        tensors = _tensors_of(args, kwargs)
        constants = self._constants
        if not any(self._followed(t) for t in tensors):
            out = func(*args, **kwargs)
            # made from no tensor, or from constants alone
            if not tensors or (constants.added and all(t in constants for t in tensors)):
                for t in _outputs(out):
                    constants.add(t)
            return out
        # Computed from weights and constants alone: a weight too. An activation among the
        # inputs (an embedding's indices, the forward's input) makes the result an activation.
        weight_only = all(self._followed(t) or t.dim() == 0 or t in constants for t in tensors)
        scope = self.current()
        weight_only = weight_only or (scope is not None and scope.computing)
        if scope is not None and weight_only and not scope.computing:
            # F.linear names its weight: a weight or constant as its input (a learned query,
            # a fixed positional table) is an activation of the module that runs it.
            weight_only = not (func is F.linear and self._followed(_linear_weight(args, kwargs)))
            if weight_only and (func in OPS or func in REFUSED or func is RMATMUL):
                _note(scope, label(func) + " computing a weight (on weights and constants alone)")
        if scope is not None and not weight_only:
            served = _serve(self, scope, func, args, kwargs)
            if served is not None:
                if self.on_serve is not None:
                    self.on_serve()
                return served
        out = func(*args, **kwargs)
        if weight_only:
            self.follow(_outputs(out))
        return out


def _linear_weight(args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    return args[1] if len(args) > 1 else kwargs.get("weight")


def _note(scope: Scope, spelled: str) -> None:
    """Keep ``spelled`` among the calls that took one of the scope's weights (its error)."""
    if len(scope.called) < 8 and spelled not in scope.called:
        scope.called.append(spelled)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


def _bind(
    scope: Scope, func: Any, label: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[str, list[Any], tuple[Any, Any]]:
    """A served op's kind, its operands in its signature's order (absent: None) and its
    ``beta, alpha``;
    refuses what the recipe's matmul cannot take (``out=``, ``out_dtype=``)."""
    kind, names = ("rproduct", PAIR) if func is RMATMUL else OPS[func]
    known = (*names, *SCALES) if kind == "addproduct" else names
    extra = [k for k in kwargs if k not in known]
    if len(args) > len(names) or extra:
        what = f"{label} with {', '.join(f'{k}=' for k in extra) or 'extra arguments'}"
        _refuse(scope.name, what)
    bound = dict(zip(names, args, strict=False))
    operands = [bound.get(n, kwargs.get(n)) for n in names]
    return kind, operands, (kwargs.get("beta", 1), kwargs.get("alpha", 1))


def _serve(
    mode: Fp8Mode, scope: Scope, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> torch.Tensor | None:
    """The served result of a matmul on a weight operand and an activation; None: not a matmul
    on a weight (run as written). Refuses a matmul on a weight that the recipe cannot run."""
    spelled = label(func)
    _note(scope, spelled)
    if func is not RMATMUL and func not in OPS:
        if func in REFUSED:
            _refuse(scope.name, spelled)
        return None
    on = mode._followed
    kind, operands, scales = _bind(scope, func, spelled, args, kwargs)
    if kind == "linear":
        x, w, bias = operands
        if on(w):
            if w.dim() != 2:
                _refuse(scope.name, spelled, f"a {w.dim()}-D weight")
            return serve_linear(scope, x, w, bias)
        if on(x) and isinstance(w, torch.Tensor) and w.dim() in (1, 2):  # F.linear(W, x): W @ x.T
            return _serve_product(
                scope, x, w.t() if w.dim() == 2 else w, bias, spelled, True, False
            )
        if on(x):
            _refuse(scope.name, spelled)
        return None
    bias = operands.pop(0) if kind == "addproduct" else None
    a, b = reversed(operands) if kind == "rproduct" else operands
    if not (on(a) or on(b)):
        return None  # a weight in the added input alone: elementwise
    beta, alpha = scales
    if beta == 1 and alpha == 1:
        return _serve_product(scope, a, b, bias, spelled, on(a), on(b))
    out = _serve_product(scope, a, b, None, spelled, on(a), on(b))
    if out is None or bias is None:
        return out
    out = out * alpha
    return out if beta == 0 else out + bias.to(out.dtype) * beta


def _serve_product(
    scope: Scope,
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    label: str,
    a_weight: bool,
    b_weight: bool,
) -> torch.Tensor | None:
    """``a @ b (+ bias)`` with the weight operand as the recipe's weight."""
    if b_weight and not a_weight and b.dim() == 2:  # x @ B: the weight is B.T
        return serve_linear(scope, a, b.t(), bias)
    if a_weight and not b_weight and a.dim() == 2:  # W @ x = (x.T @ W.T).T
        out = serve_linear(scope, b.mT if b.dim() > 1 else b, a, None)
        out = out.mT if b.dim() > 1 else out
        return out if bias is None else out + bias.to(out.dtype)
    _refuse(scope.name, label, f"a {(a if a_weight else b).dim()}-D weight")
    return None


def _unservable(name: str, what: str, on: str = "one of its weights") -> str:
    if what == "F.multi_head_attention_forward":
        return attention_message(name)
    shown = repr(name) if name else "the model"
    return (
        f"an fp8-family rule serves module {shown}, whose forward runs {what} on {on}: the "
        f"recipe runs {SERVES}, not that. Give the module a rule that is not fp8 "
        f"(e.g. '{name or '<module>'}=bf16'), or write that matmul as one of those."
    )


@disable_dynamo
def _refuse(name: str, label: str, on: str = "one of its weights") -> None:
    # Dynamo runs this eagerly (a graph break), so the error reaches the user.
    raise ConfigError(_unservable(name, label, on))


def attention_message(name: str) -> str:
    """The error for an fp8 rule that reaches an ``nn.MultiheadAttention``. Host sync: none."""
    shown = repr(name) if name else "the model"
    return (
        f"an fp8 rule reaches nn.MultiheadAttention {shown}: its forward calls "
        "F.multi_head_attention_forward with its packed projection weights, so no fp8 rule can "
        "serve its projections (out_proj's own forward never runs). Give it a rule of its own "
        f"that is not fp8 (e.g. '{name or '<module>'}=bf16', or "
        "Policy(modules={nn.MultiheadAttention: 'bf16'})), or build the attention from "
        "nn.Linear projections and F.scaled_dot_product_attention."
    )


def served_nothing(scope: Scope, kind: str) -> ConfigError:
    """The error of a guarded scope that closed having served no matmul. Host sync: none."""
    shown = repr(scope.name) if scope.name else "the model"
    called = ", ".join(scope.called) if scope.called else "no torch function on its weights"
    return ConfigError(
        f"module {shown} ({kind}) ran under an fp8-family rule ({scope.recipe.name}) and issued "
        f"no matmul the recipe serves: with its weights it called {called}. fp8 serves "
        f"{SERVES}. {_NOT_FOLLOWED} Give it a rule that is not fp8 (e.g. "
        f"'{scope.name or '<module>'}=bf16'), or compute its matmuls with one of those."
    )


_NOT_FOLLOWED = (
    "A weight operand is followed from the module's parameters and buffers through the torch "
    "functions this forward runs on them; one computed outside this forward (kept across "
    "forwards: torch.nn.utils.parametrize.cached(), a tensor saved on the module) or, under "
    "torch.compile, read through a tensor attribute Dynamo does not show to torch function "
    "modes (.data; .T, .mT, .H before torch 2.14: write .detach(), .t(), .transpose(-2, -1)) "
    "is not. A tensor made in the forward by a torch function that took no tensor "
    "(torch.eye, torch.zeros, torch.randn) is a constant, not an activation: a matmul of "
    "weights and constants computes a weight and is not served."
)


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


@disable_dynamo
def refuse_stats_while_compiling() -> None:
    """Dynamo runs this eagerly (a graph break), so the error reaches the user. Host sync:
    none."""
    raise ConfigError(_STATS_COMPILE_MSG)


def stats_for_scope() -> Fp8Stats | None:
    """The :class:`~mixprec.Fp8Stats` a scope opening now records into (refused while tracing).

    Host sync: none.
    """
    stats = active_stats()
    if stats is not None and torch.compiler.is_compiling():
        refuse_stats_while_compiling()
    return stats


# ---------------------------------------------------------------- one module, standalone
class Token:
    """What :func:`enter_module` entered (for :func:`exit_module`). Host sync: none."""

    __slots__ = ("mode", "scope")

    def __init__(self, mode: Fp8Mode, scope: Scope) -> None:
        self.mode, self.scope = mode, scope


def enter_module(
    module: nn.Module, name: str | None, recipe: Recipe, hp: torch.dtype, label: str | None = None
) -> Token:
    """Serve every matmul on ``module``'s weights by ``recipe`` until :func:`exit_module`
    (whatever calls them), with ``hp`` the dtype around them; while an
    :class:`~mixprec.Fp8Stats` is entered, the casts are recorded under ``name`` (and the
    recipe name ``label``, default the recipe's).

    Example:
        >>> from mixprec._src.fp8.recipes import get_recipe
        >>> lin = nn.Linear(4, 3)
        >>> token = enter_module(lin, "lin", get_recipe("tensorwise"), torch.float32)
        >>> y = lin(torch.randn(2, 4)); exit_module(token)

    Host sync: none.
    """
    scope = Scope(name or "", recipe, hp, stats_for_scope(), False, label=label)
    mode = Fp8Mode(list(module.parameters()), lambda: scope)
    mode.__enter__()
    return Token(mode, scope)


def exit_module(token: Token | None) -> None:
    """Undo :func:`enter_module`. Host sync: none."""
    if token is not None:
        token.mode.__exit__(None, None, None)
