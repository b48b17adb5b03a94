"""The low-precision recipes: how each operand of a Linear's three matmuls is cast.

A Linear ``y = x @ W.T`` runs three matmuls, each on two operands:

=============  =====================  =========================
matmul         operand a              operand b
=============  =====================  =========================
output         input ``x``            weight ``W``
grad_input     grad_output ``dy``     weight ``W``
grad_weight    grad_output ``dy``     input ``x``
=============  =====================  =========================

Each operand gets a :class:`Cast`: the element format, the block its scale covers, how that
scale is computed and stored, the rounding, and an optional Hadamard transform. Blocks are
described relative to the *contraction* dimension of the matmul the operand enters
(``block = (across, along)``), so every scale factors out of the dot products it enters: a
tensorwise cast is ``(0, 0)`` (0 = the whole dimension), a rowwise one ``(1, 0)``, MXFP8's
``(1, 32)``, a 128x128 weight block ``(128, 128)``. A matmul whose two casts are ``None`` runs in
the high-precision dtype.

A recipe is data (:data:`RECIPES`); the rule words that name them are :data:`WORDS`
(``"fp8"``, ``"fp8:rowwise"``, ``"mxfp8"``, ``"nvfp4"``...). One mechanism (``matmul.py``) runs
every recipe.

A recipe can also be put together per matmul (:func:`compose`): each of the three matmuls takes
its casts from a recipe of the registry or runs in a high-precision dtype (:data:`HIGH`); its
name lists the parts in matmul order, ``"mxfp8/mxfp8/nvfp4"`` or ``"bf16/tensorwise/tensorwise"``
(:data:`MATMULS`: the output, the input gradient and the weight gradient, which
TransformerEngine calls fprop, dgrad and wgrad).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mixprec.errors import ConfigError

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
E2M1 = torch.float4_e2m1fn_x2  # the format tag of fp4 elements (held unpacked, one per byte)
_FORMAT_NAMES = {E4M3: "e4m3", E5M2: "e5m2", E2M1: "e2m1"}

#: How a block's scale is computed and stored (``casts.py`` implements each):
#: ``amax``: fp32 ``fmt_max / amax``, values ``x * scale`` (torchao.float8); ``pow2``: that
#: rounded down to a power of two; ``amax_div``: fp32 ``amax / fmt_max``, values ``x / scale``
#: (DeepSeek-V3); ``e8m0``: a power of two stored as E8M0, rounded up (RCEIL: cuBLAS, torchao,
#: TransformerEngine); ``e4m3_fp32``: an E4M3 block scale under one fp32 tensor scale (NVFP4).
SCALES = ("amax", "pow2", "amax_div", "e8m0", "e4m3_fp32")


@dataclass(frozen=True)
class Cast:
    """How one operand is cast for one matmul.

    Attributes:
        dtype: the element format: ``E4M3`` (max 448), ``E5M2`` (max 57344) or ``E2M1`` (fp4,
            max 6).
        block: ``(across, along)`` the contraction dimension; 0 = the whole dimension.
        scale: one of :data:`SCALES`.
        stochastic: stochastic rounding of the elements (else round to nearest, ties to even).
        hadamard: a 16x16 random Hadamard transform along the contraction dimension first.

    Example:
        >>> Cast(E4M3, block=(1, 32), scale="e8m0").short
        'e4m3/1x32/e8m0'

    Host sync: none.
    """

    dtype: torch.dtype
    block: tuple[int, int] = (0, 0)
    scale: str = "amax"
    stochastic: bool = False
    hadamard: bool = False

    def __post_init__(self) -> None:
        assert self.dtype in _FORMAT_NAMES and self.scale in SCALES, self

    @property
    def rowwise(self) -> bool:
        """One scale per row along the contraction dimension (torchao's axis-wise scaling).
        Host sync: none."""
        return self.block == (1, 0)

    @property
    def tensorwise(self) -> bool:
        """One scale for the whole tensor. Host sync: none."""
        return self.block == (0, 0)

    @property
    def square(self) -> bool:
        """Scaled in square 2D blocks (or tensorwise), the same along either dimension: one
        cast serves both matmuls the operand enters. Host sync: none."""
        across, along = self.block
        return across == along and not (self.stochastic or self.hadamard)

    @property
    def short(self) -> str:
        """A short label, e.g. ``e5m2/tensor/amax``. Host sync: none."""
        across, along = self.block
        shape = {(0, 0): "tensor", (1, 0): "row"}.get(self.block, f"{across}x{along}")
        text = f"{_FORMAT_NAMES[self.dtype]}/{shape}/{self.scale}"
        return text + ("/sr" if self.stochastic else "") + ("/rht" if self.hadamard else "")


@dataclass(frozen=True)
class Recipe:
    """The casts of the six (matmul, operand) pairs of a Linear; ``None`` = high precision.

    Attributes:
        name: the recipe's name (``"tensorwise"``, ``"mxfp8"``, ...).
        x: input for the output matmul.          w: weight for the output matmul.
        dy_gi: grad_output for grad_input.       w_gi: weight for grad_input.
        dy_gw: grad_output for grad_weight.      x_gw: input for grad_weight.
        capability: the CUDA compute capabilities its hardware matmuls run on:
            ``(lowest, above the highest)``.
        high: per matmul (:data:`MATMULS` order), the dtype the operands of a matmul whose
            casts are ``None`` are rounded to, for torch's matmul in that dtype (autocast's);
            None: the region's dtype, as they arrive.
        parts: a recipe put together per matmul (:func:`compose`): per matmul, the recipe its
            casts come from or the :data:`HIGH` word it runs in; empty for the registry's.

    Example:
        >>> get_recipe("rowwise").x.short
        'e4m3/row/pow2'

    Host sync: none.
    """

    name: str
    x: Cast | None
    w: Cast | None
    dy_gi: Cast | None
    w_gi: Cast | None
    dy_gw: Cast | None
    x_gw: Cast | None
    capability: tuple[tuple[int, int], tuple[int, int]] = ((8, 9), (99, 0))
    high: tuple[torch.dtype | None, torch.dtype | None, torch.dtype | None] = (None, None, None)
    parts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for a, b in self.pairs:
            assert (a is None) == (b is None), "both operands of a matmul cast, or neither"
        assert any(a is not None for a, _ in self.pairs), "some matmul runs in low precision"
        for act in (self.x, self.dy_gi):  # tokens are never blocked across: any batch works
            assert act is None or act.block[0] in (0, 1), self

    @property
    def pairs(self) -> tuple[tuple[Cast | None, Cast | None], ...]:
        """The casts of each matmul's operands, in :data:`MATMULS` order. Host sync: none."""
        return ((self.x, self.w), (self.dy_gi, self.w_gi), (self.dy_gw, self.x_gw))

    @property
    def sources(self) -> tuple[Recipe | None, Recipe | None, Recipe | None]:
        """Per matmul, the registry recipe whose casts it runs (None: high precision).

        Example:
            >>> [None if r is None else r.name for r in get_recipe("bf16/mxfp8/nvfp4").sources]
            [None, 'mxfp8', 'nvfp4']

        Host sync: none.
        """
        names = self.parts or (self.name,) * 3
        pairs = zip(names, self.pairs, strict=True)
        found = [RECIPES.get(n) if a is not None else None for n, (a, _) in pairs]
        return found[0], found[1], found[2]

    @property
    def blocked(self) -> bool:
        """Some operand is scaled per block (not per tensor or row). Host sync: none."""
        return any(c is not None and c.block[1] > 0 for c in self.casts)

    @property
    def casts(self) -> tuple[Cast | None, ...]:
        """The six casts in field order. Host sync: none."""
        return (self.x, self.w, self.dy_gi, self.w_gi, self.dy_gw, self.x_gw)

    def multiples(self) -> tuple[int, int, int]:
        """What ``(tokens, in_features, out_features)`` must be multiples of for the blocks to
        tile them (tokens are padded, features checked).

        Example:
            >>> get_recipe("mxfp8").multiples()
            (32, 32, 32)

        Host sync: none.
        """
        m = k = n = 1
        # (cast, the dimension it contracts along, the dimension across)
        for cast, along, across in (
            (self.x, "k", "m"),
            (self.w, "k", "n"),
            (self.dy_gi, "n", "m"),
            (self.w_gi, "n", "k"),
            (self.dy_gw, "m", "n"),
            (self.x_gw, "m", "k"),
        ):
            if cast is None:
                continue
            need = {along: cast.block[1] or 1, across: cast.block[0] or 1}
            if cast.hadamard:
                need[along] = math.lcm(need[along], 16)
            m = math.lcm(m, need.get("m", 1))
            k = math.lcm(k, need.get("k", 1))
            n = math.lcm(n, need.get("n", 1))
        return m, k, n


_T4 = Cast(E4M3)
_T5 = Cast(E5M2)
_R4 = Cast(E4M3, block=(1, 0), scale="pow2")
_MX = Cast(E4M3, block=(1, 32), scale="e8m0")
_B1 = Cast(E4M3, block=(1, 128), scale="amax_div")
_B2 = Cast(E4M3, block=(128, 128), scale="amax_div")
_N1 = Cast(E2M1, block=(1, 16), scale="e4m3_fp32")
_N2 = Cast(E2M1, block=(16, 16), scale="e4m3_fp32")
_NSR = Cast(E2M1, block=(1, 16), scale="e4m3_fp32", stochastic=True)
_NSRH = Cast(E2M1, block=(1, 16), scale="e4m3_fp32", stochastic=True, hadamard=True)
_NH = Cast(E2M1, block=(1, 16), scale="e4m3_fp32", hadamard=True)

RECIPES: dict[str, Recipe] = {
    # e4m3 input and weight, e5m2 gradients, one scale per tensor (torchao.float8).
    "tensorwise": Recipe("tensorwise", _T4, _T4, _T5, _T4, _T5, _T4),
    # e4m3 everywhere, power-of-two scales per row along each contraction dimension.
    "rowwise": Recipe("rowwise", _R4, _R4, _R4, _R4, _R4, _R4),
    # rowwise forward and grad_input (weight tensorwise there); grad_weight in high precision.
    "rowwise_gw_hp": Recipe("rowwise_gw_hp", _R4, _R4, _R4, Cast(E4M3, scale="pow2"), None, None),
    # DeepSeek-V3: 1x128 tiles for activations and gradients, 128x128 weight blocks, e4m3,
    # fp32 scale amax / 448 per block (not a power of two). torch's kernels: Hopper only.
    "blockwise": Recipe("blockwise", _B1, _B2, _B1, _B2, _B1, _B1, capability=((9, 0), (10, 0))),
    # OCP MX: e4m3 in 32-element blocks along each contraction dimension, E8M0 scales (RCEIL).
    "mxfp8": Recipe("mxfp8", _MX, _MX, _MX, _MX, _MX, _MX, capability=((10, 0), (99, 0))),
    # NVFP4 pretraining (arXiv 2509.25149): e2m1 in 1x16 blocks with E4M3 scales and an fp32
    # tensor scale; 16x16 weight blocks; gradients stochastically rounded; a 16x16 random
    # Hadamard transform on both inputs of the grad_weight matmul.
    "nvfp4": Recipe("nvfp4", _N1, _N2, _NSR, _N2, _NSRH, _NH, capability=((10, 0), (99, 0))),
}

#: The rule words of the low-precision family and their recipes (the first is the default):
#: ``"fp8"`` = ``"fp8:tensorwise"``, ``"fp8:blockwise"``, ``"mxfp8"``, ``"nvfp4"``...
WORDS: dict[str, tuple[str, ...]] = {
    "fp8": ("tensorwise", "rowwise", "rowwise_gw_hp", "blockwise"),
    "mxfp8": ("mxfp8",),
    "nvfp4": ("nvfp4",),
}
DEFAULT = "tensorwise"
ALIASES = {"rowwise_with_gw_hp": "rowwise_gw_hp"}  # torchao's spelling

#: The three matmuls of a Linear in the order they run: the output, the input gradient, the
#: weight gradient (TransformerEngine's fprop, dgrad, wgrad).
MATMULS = ("fprop", "dgrad", "wgrad")
#: The high-precision formats one matmul of a recipe put together per matmul may run in: its
#: operands rounded to the dtype, torch's matmul in it (autocast's), the result in the region's
#: dtype.
HIGH = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def canonical(recipe: str) -> str:
    """A recipe name as the registry spells it (torchao's ``rowwise_with_gw_hp`` too).

    Example:
        >>> canonical(" Rowwise_With_GW_HP ")
        'rowwise_gw_hp'

    Host sync: none.
    """
    word = recipe.strip().lower()
    return ALIASES.get(word, word)


def rule_word(recipe: str) -> str:
    """The shortest rule word that names ``recipe`` (``"fp8"``, ``"fp8:rowwise"``, ``"mxfp8"``).

    Example:
        >>> rule_word("tensorwise"), rule_word("blockwise"), rule_word("nvfp4")
        ('fp8', 'fp8:blockwise', 'nvfp4')

    Host sync: none.
    """
    for word, names in WORDS.items():
        if recipe == names[0]:
            return word
        if recipe in names:
            return f"{word}:{recipe}"
    raise ConfigError(f"unknown low-precision recipe {recipe!r}; accepted: {_accepted()}")


def get_recipe(name: str) -> Recipe:
    """The recipe called ``name`` (``""`` is the default, tensorwise): a registry recipe, or
    one put together per matmul, its parts separated by ``/`` (:func:`compose`).

    Example:
        >>> get_recipe("").name
        'tensorwise'
        >>> get_recipe("mxfp8/mxfp8/nvfp4").parts
        ('mxfp8', 'mxfp8', 'nvfp4')

    Raises:
        ConfigError: an unknown name; the message lists the recipes.

    Host sync: none.
    """
    if "/" in name:
        # Composed once, then looked up: a dict read is what Dynamo traces in a compiled forward.
        found = _COMPOSED.get(name)
        return compose(tuple(name.split("/"))) if found is None else found
    found = RECIPES.get(canonical(name) or DEFAULT)
    if found is None:
        raise ConfigError(f"unknown fp8 recipe {name!r}; accepted: {_accepted()}")
    return found


_COMPOSED: dict[str, Recipe] = {}  # every recipe composed, by the names it was asked for


def compose(parts: tuple[str, ...]) -> Recipe:
    """The recipe whose matmuls (:data:`MATMULS` order) take their casts from the registry's
    recipes named in ``parts``, or run in a :data:`HIGH` dtype: ``("mxfp8", "mxfp8", "nvfp4")``.
    Three equal recipe names give that recipe. Its hardware matmuls run where every part's do.

    Example:
        >>> r = compose(("bf16", "tensorwise", "tensorwise"))
        >>> r.name, r.x is None, r.high[0], r.dy_gi.short
        ('bf16/tensorwise/tensorwise', True, torch.bfloat16, 'e5m2/tensor/amax')

    Raises:
        ConfigError: not three parts, an unknown part, or no matmul in low precision.

    Host sync: none.
    """
    names = tuple(canonical(p) for p in parts)
    if len(names) != len(MATMULS):
        raise ConfigError(
            f"a recipe per matmul names {len(MATMULS)} parts ({'/'.join(MATMULS)}), got "
            f"{'/'.join(parts)!r}"
        )
    for part in names:
        if part not in HIGH and part not in RECIPES:
            raise ConfigError(
                f"unknown part {part!r} in {'/'.join(parts)!r}: each matmul takes a recipe "
                f"({', '.join(RECIPES)}) or a high-precision dtype ({', '.join(HIGH)})"
            )
    if len(set(names)) == 1 and names[0] in RECIPES:
        return RECIPES[names[0]]
    casts: list[Cast | None] = []
    high: list[torch.dtype | None] = []
    for i, part in enumerate(names):
        source = RECIPES.get(part)
        pair = source.pairs[i] if source is not None else (None, None)
        casts += pair
        high.append(HIGH[part] if source is None else source.high[i])
    if all(c is None for c in casts):
        raise ConfigError(
            f"{'/'.join(names)!r} runs no matmul in low precision: write the dtype as a rule of "
            "its own ('bf16'), or give some matmul a recipe"
        )
    lows = [s.capability for s in (RECIPES.get(n) for n in names) if s is not None]
    capability = (max(c[0] for c in lows), min(c[1] for c in lows))
    x, w, dy_gi, w_gi, dy_gw, x_gw = casts
    dtypes = (high[0], high[1], high[2])
    recipe = Recipe("/".join(names), x, w, dy_gi, w_gi, dy_gw, x_gw, capability, dtypes, names)
    _COMPOSED["/".join(parts)] = _COMPOSED[recipe.name] = recipe
    return recipe


def _accepted() -> str:
    words = [f'"{rule_word(n)}"' for names in WORDS.values() for n in names]
    return f'"fp8" (= "fp8:{DEFAULT}"), ' + ", ".join(w for w in words if w != '"fp8"')
