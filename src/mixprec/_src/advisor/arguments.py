"""What the user asked for, checked before the first pass: the arguments, the candidate
precisions, the modules to measure.

Each bad value is a ConfigError that names it and the fix, and nothing has run yet.

A candidate is a module rule word of :class:`mixprec.Policy`: ``"fp16"``, ``"bf16"``, or any
word of a recipe in the fp8 registry (``"fp8"``, ``"fp8:rowwise"``, ...): a rule whose compute
word takes a recipe. For each one the advisor needs three things: which modules it can serve,
how to run one module in it while the rest of the model stays in float32 (the isolated pass),
and the autocast region dtype a policy using it runs in. An fp8 candidate runs the module's own
matmuls on fp8 operands through the fp8 package's module hook, with the region's dtype around
them (their results are rounded to it, as under the policy), and records the module's fp8 cast
statistics.
"""

from __future__ import annotations

import difflib
import fnmatch
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from mixprec._src.advisor.choose.search import OBJECTIVES
from mixprec._src.autocast.rules import Rule, format_dtype
from mixprec._src.fp8 import hook as fp8_hook
from mixprec._src.fp8.recipes import RECIPES, get_recipe
from mixprec._src.torch_compat import COMPILED_INNER, NORM_BASE, is_compiled_module
from mixprec.errors import ConfigError

LOSS_FORM = (
    "the advisor calls it as loss_fn(model, batch): it runs the model on the batch and returns "
    "the loss, e.g. lambda model, batch: F.mse_loss(model(batch[0]), batch[1])"
)


def check_args(
    model: object,
    loss_fn: object,
    numbers: tuple[object, object],
    flags: tuple[object, object, object],
    objective: object,
) -> None:
    """``numbers``: (min_sqnr, keep_at_most); ``flags``: (check, more_batches, progress)."""
    check_model(model)
    if not callable(loss_fn):
        raise ConfigError(f"loss_fn must be callable; {LOSS_FORM}; got {type(loss_fn).__name__}")
    _check_numbers(*numbers)
    check, more_batches, progress = flags
    if not isinstance(check, bool):
        raise ConfigError(f"check must be True or False, got {check!r}")
    if not isinstance(more_batches, (list, tuple)):
        raise ConfigError(
            f"more_batches must be a list or tuple of further batches, got "
            f"{type(more_batches).__name__} {_short(more_batches)}"
        )
    if progress is not None and not callable(progress):
        raise ConfigError(
            "progress must be None or a function called as progress(done, total, label), got "
            f"{type(progress).__name__} {_short(progress)}"
        )
    if objective not in OBJECTIVES:
        raise ConfigError(
            f"objective must be one of {', '.join(map(repr, OBJECTIVES))}, got {objective!r}"
        )


def check_speedup(min_speedup: object, objective: object) -> None:
    """``min_speedup`` goes with ``objective="sqnr"`` (and only with it): a number above 0."""
    if objective == "sqnr" and min_speedup is None:
        raise ConfigError(
            'objective="sqnr" needs min_speedup: the least predicted speedup against bf16 '
            "(e.g. min_speedup=1.5), within which the most precise policy is chosen"
        )
    if min_speedup is None:
        return
    if objective != "sqnr":
        raise ConfigError(
            f'min_speedup goes with objective="sqnr" (the most precise policy at least that '
            f"much faster than bf16), got objective={objective!r}"
        )
    if (
        isinstance(min_speedup, bool)
        or not isinstance(min_speedup, (int, float))
        or not (0 < min_speedup < math.inf)
    ):
        raise ConfigError(f"min_speedup must be a number above 0, got {min_speedup!r}")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_numbers(min_sqnr: object, keep_at_most: object) -> None:
    if min_sqnr is not None and (
        isinstance(min_sqnr, bool)
        or not isinstance(min_sqnr, (int, float))
        or not math.isfinite(min_sqnr)
    ):
        raise ConfigError(f"min_sqnr must be a finite number of dB or None, got {min_sqnr!r}")
    if keep_at_most is not None and (
        isinstance(keep_at_most, bool) or not isinstance(keep_at_most, int) or keep_at_most < 0
    ):
        raise ConfigError(f"keep_at_most must be an int >= 0 or None, got {keep_at_most!r}")


def check_float32(model: nn.Module) -> None:
    """The reference is the model's own float32 run: 16-bit parameters or buffers cannot give
    one."""
    named = [*model.named_parameters(), *model.named_buffers()]
    low = [(n, t.dtype) for n, t in named if t.is_floating_point() and t.element_size() < 4]
    if low:
        name, dtype = low[0]
        raise ConfigError(
            f"the model has {len(low)} {str(dtype).removeprefix('torch.')} parameters or "
            f"buffers (first: {name!r}); the advisor compares low precision with the model's "
            "float32 run, so it needs float32 parameters: advise a float32 copy "
            "(copy.deepcopy(model).float(), with float32 inputs) and train with the proposed "
            "policy under mixprec.autocast, which keeps float32 master weights"
        )


def check_loss_signature(loss_fn: Callable[..., Any], model: nn.Module, batch: Any) -> None:
    """A loss function that cannot take two positional arguments is refused up front."""
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # a builtin without a signature: the first call tells
        return
    try:
        signature.bind(model, batch)
    except TypeError as exc:
        raise ConfigError(
            f"loss_fn{signature} cannot be called with (model, batch) ({exc}); {LOSS_FORM}"
        ) from None


def device_of(model: nn.Module) -> torch.device:
    """Where the model's first parameter or buffer lives (the CPU for an empty model)."""
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def check_model(model: object) -> None:
    """A module the advisor can name as autocast does: not ``torch.compile``'s wrapper, under
    which every module is named ``_orig_mod.<name>`` (a module compiled in place, with
    ``Module.compile()``, keeps its names: the passes run its eager forward).

    Raises:
        ConfigError: not a module, or a wrapper (the message says what to pass).
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    compiled = next((n for n, m in model.named_modules() if is_compiled_module(m)), None)
    if compiled is not None:
        what = "model is" if not compiled else f"model.{compiled} is"
        raise ConfigError(
            f"{what} a torch.compile'd module, whose modules are named under .{COMPILED_INNER} "
            "where a policy names them without it; the advisor measures the eager model: pass the "
            f"module you compiled (its .{COMPILED_INNER}, the same parameters) and train the "
            "compiled one with the proposed policy"
        )


_16BIT = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Candidate:
    """One candidate precision: its rule word, and its dtype (16-bit) or fp8 recipe."""

    word: str
    dtype: torch.dtype | None
    recipe: str | None = None

    @staticmethod
    def of(word: object) -> Candidate:
        """The candidate a rule word names. Raises ConfigError for another word."""
        return _parse_one(word)

    @property
    def is_fp16(self) -> bool:
        return self.dtype == torch.float16

    @property
    def splits(self) -> bool:
        """A registry recipe, whose matmuls the advisor can measure and choose one by one (a
        rule per matmul given as a candidate is measured whole)."""
        return self.recipe is not None and "/" not in self.recipe

    def serves(self, module: nn.Module) -> bool:
        """Whether this precision can be applied to ``module`` (16-bit: any module; a recipe:
        an ``nn.Linear`` whose features its blocks tile)."""
        return self.why_not(module) is None

    def why_not(self, module: nn.Module) -> str | None:
        """Why this precision cannot serve ``module``, None where it can."""
        if self.recipe is None:
            return None
        weight = getattr(module, "weight", None)
        if not fp8_hook.can_serve(type(module)) or not isinstance(weight, torch.Tensor):
            return f"{self.word} serves {fp8_hook.SERVES}"
        _, k, n = get_recipe(self.recipe).multiples()
        if weight.dim() != 2:
            return f"{self.word} serves 2D weights"
        out_features, in_features = weight.shape
        if in_features % k:
            return f"in_features {in_features} is not a multiple of {self.word}'s block {k}"
        if out_features % n:
            return f"out_features {out_features} is not a multiple of {self.word}'s block {n}"
        return None


def _default_word(device_type: str) -> str:
    """The word of torch's autocast dtype for the device type (as ``mixprec.autocast``)."""
    try:
        default = torch.get_autocast_dtype(device_type)
    except RuntimeError:  # a device type without autocast: the region's own error comes later
        return "fp16"
    return "bf16" if default == torch.bfloat16 else "fp16"


def parse_candidates(words: Sequence[object] | str | None, device_type: str) -> list[Candidate]:
    """Validate candidate words (in the order given; the advisor sorts them by cost);
    ``None`` is the device's autocast default.

    Raises:
        ConfigError: an empty list, a duplicate, or a word that is not a low-precision rule.
    """
    if words is None:
        words = [_default_word(device_type)]
    elif isinstance(words, str):
        words = [w for w in words.replace(" ", "").split(",") if w]
    if not words:
        raise ConfigError("candidates is empty; pass e.g. candidates=['fp16'] or ['bf16']")
    out: list[Candidate] = []
    for word in words:
        cand = _parse_one(word)
        if any(c.word == cand.word for c in out):
            raise ConfigError(f"candidate {cand.word!r} is listed twice in {list(words)!r}")
        out.append(cand)
    return out


def _parse_one(word: object) -> Candidate:
    if isinstance(word, torch.dtype):
        word = format_dtype(word)
    if not isinstance(word, str):
        raise ConfigError(
            f"candidate {word!r} has type {type(word).__name__}; candidates are rule words "
            "such as 'fp16' or 'bf16'"
        )
    rule = Rule(word)  # raises ConfigError listing the accepted words
    if rule.output is None and isinstance(rule.compute, str) and rule.recipe is not None:
        return Candidate(str(rule), None, rule.recipe)  # a recipe of the fp8 registry
    if rule.output is not None or rule.compute not in _16BIT:
        recipes = ", ".join(f"'fp8:{name}'" for name in RECIPES)
        raise ConfigError(
            f"candidate {word!r} is not a low precision; candidates are 'fp16', 'bf16' (the "
            f"regions' dtypes) or the fp8 registry's recipe words ('fp8', {recipes}, ...), "
            "in any order"
        )
    assert isinstance(rule.compute, torch.dtype)
    return Candidate(str(rule), rule.compute)


def region_dtype(candidates: Sequence[Candidate]) -> torch.dtype:
    """The autocast dtype of the proposed region: the first 16-bit candidate, else bfloat16
    (fp8 matmuls run inside a 16-bit region)."""
    for cand in candidates:
        if cand.dtype is not None:
            return cand.dtype
    return torch.bfloat16


def high_word(candidates: Sequence[Candidate], region: torch.dtype) -> str:
    """What a module kept out of every candidate runs in: float32 if the region's dtype is a
    candidate, else the region's dtype (e.g. bf16 when the candidates are fp8 recipes)."""
    if any(c.dtype == region for c in candidates):
        return "fp32"
    return format_dtype(region)


@dataclass(frozen=True)
class Chosen:
    """A module to measure, the candidates that serve it, and why the others do not."""

    name: str
    module: nn.Module
    serving: tuple[Candidate, ...]
    why_not: str


def choose_modules(
    model: nn.Module, spec: Sequence[object] | None, cands: Sequence[Candidate]
) -> list[Chosen]:
    """The modules to measure (:func:`select`), each with its serving candidates.

    Raises:
        ConfigError: as :func:`select`, or a candidate that serves none of them.
    """
    chosen = select(model, spec)
    check_served(cands, chosen)
    return [
        Chosen(n, m, tuple(c for c in cands if c.serves(m)), unserved_reason(cands, m))
        for n, m in chosen
    ]


def unserved_reason(candidates: Sequence[Candidate], module: nn.Module) -> str:
    """Why no candidate serves ``module``: each candidate's reason, the same ones once."""
    reasons = [r for c in candidates if (r := c.why_not(module)) is not None]
    return "; ".join(dict.fromkeys(reasons))


def check_served(cands: Sequence[Candidate], chosen: Sequence[tuple[str, nn.Module]]) -> None:
    """Every candidate must serve at least one measured module.

    Raises:
        ConfigError: one serves none; the message says why for the first few modules.
    """
    for cand in cands:
        if any(cand.serves(m) for _, m in chosen):
            continue
        shown = [f"{n} ({type(m).__name__}: {cand.why_not(m)})" for n, m in chosen[:4]]
        more = f" and {len(chosen) - 4} more" if len(chosen) > 4 else ""
        raise ConfigError(
            f"candidate {cand.word!r} serves none of the measured modules: "
            f"{', '.join(shown)}{more}; measure other modules (modules=[...]) or drop it"
        )


# Modules that autocast already runs in float32 or that do no arithmetic worth lowering: they
# are left out of the default selection (name them in ``modules=`` to measure them anyway).
_SKIPPED: tuple[type[nn.Module], ...] = (
    NORM_BASE,
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
            raise _no_match(entry, [n for n, _ in named])
        picked.update(matches)
    chosen = [(n, m) for n, m in named if n in picked]
    _check_disjoint([n for n, _ in chosen])
    return chosen


def _no_match(entry: object, names: list[str]) -> ConfigError:
    close = difflib.get_close_matches(str(entry), names, n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
    shown = ", ".join(repr(n) for n in names[:30])
    more = f" and {len(names) - 30} more" if len(names) > 30 else ""
    return ConfigError(
        f"modules entry {entry!r} matches no submodule of the model.{hint} Names: {shown}{more}"
    )


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
