"""The fp8 recipes: how each operand of a Linear's three matmuls is cast.

A Linear ``y = x @ W.T`` runs three matmuls, each on two operands:

=============  =====================  =========================
matmul         operand a              operand b
=============  =====================  =========================
output         input ``x``            weight ``W``
grad_input     grad_output ``dy``     weight ``W``
grad_weight    grad_output ``dy``     input ``x``
=============  =====================  =========================

Each operand gets a :class:`Cast`: the fp8 format and the granularity of its scale. Axis-wise
("rowwise") scales are taken along the contraction dimension of the matmul the operand enters,
so one scale per row of ``x`` for the output, one per output feature of ``W``, and so on: the
scales factor out of every dot product. A matmul whose two casts are ``None`` runs in the high
precision dtype. The recipes mirror torchao.float8's of the same names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixprec.errors import ConfigError

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_FORMAT_NAMES = {E4M3: "e4m3", E5M2: "e5m2"}


@dataclass(frozen=True)
class Cast:
    """How one operand is cast to fp8 for one matmul.

    Attributes:
        dtype: ``torch.float8_e4m3fn`` (max 448) or ``torch.float8_e5m2`` (max 57344, wider range).
        rowwise: one scale per slice along the contraction dimension (else one per tensor).
        pow2: scales rounded down to a power of two (exact to apply and to undo).

    Example:
        >>> Cast(E4M3, rowwise=True, pow2=True).short
        'e4m3/row/pow2'

    Host sync: none.
    """

    dtype: torch.dtype
    rowwise: bool = False
    pow2: bool = False

    @property
    def short(self) -> str:
        """A short label, e.g. ``e5m2/tensor``. Host sync: none."""
        text = f"{_FORMAT_NAMES[self.dtype]}/{'row' if self.rowwise else 'tensor'}"
        return text + ("/pow2" if self.pow2 else "")


@dataclass(frozen=True)
class Recipe:
    """The casts of the six (matmul, operand) pairs of a Linear; ``None`` = high precision.

    Attributes:
        name: the recipe word used in policies (``"tensorwise"``, ``"rowwise"``, ...).
        x: input for the output matmul.          w: weight for the output matmul.
        dy_gi: grad_output for grad_input.       w_gi: weight for grad_input.
        dy_gw: grad_output for grad_weight.      x_gw: input for grad_weight.

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

    def __post_init__(self) -> None:
        for a, b in ((self.x, self.w), (self.dy_gi, self.w_gi), (self.dy_gw, self.x_gw)):
            assert (a is None) == (b is None), "both operands of a matmul fp8, or neither"


_T4 = Cast(E4M3)
_T5 = Cast(E5M2)
_R4 = Cast(E4M3, rowwise=True, pow2=True)

RECIPES: dict[str, Recipe] = {
    # e4m3 input and weight, e5m2 gradients, one scale per tensor.
    "tensorwise": Recipe("tensorwise", _T4, _T4, _T5, _T4, _T5, _T4),
    # e4m3 everywhere, power-of-two scales per row along each contraction dimension.
    "rowwise": Recipe("rowwise", _R4, _R4, _R4, _R4, _R4, _R4),
    # rowwise forward and grad_input (weight tensorwise there); grad_weight in high precision.
    "rowwise_gw_hp": Recipe("rowwise_gw_hp", _R4, _R4, _R4, Cast(E4M3, pow2=True), None, None),
}
DEFAULT = "tensorwise"
ALIASES = {"rowwise_with_gw_hp": "rowwise_gw_hp"}  # torchao's spelling


def get_recipe(name: str) -> Recipe:
    """The recipe called ``name`` (``""`` is the default, tensorwise).

    Example:
        >>> get_recipe("").name
        'tensorwise'

    Raises:
        ConfigError: an unknown name; the message lists the recipes.

    Host sync: none.
    """
    word = name.strip().lower() or DEFAULT
    word = ALIASES.get(word, word)
    found = RECIPES.get(word)
    if found is None:
        accepted = ", ".join(f'"fp8:{n}"' for n in RECIPES)
        raise ConfigError(
            f'unknown fp8 recipe {name!r}; accepted: "fp8" (= "fp8:{DEFAULT}"), {accepted}'
        )
    return found
