"""#36 item 3, a rule serves the module's own matmuls: the differential harness of #32
(tests/fp8_harness.py: bitwise the oracle, a Linear under the same rule written out in
tests/fp8_oracle.py) over

- every spelling torch accepts for the matmul that consumes the weight (functions, methods,
  operators, the ``torch.linalg`` alias, positional or keyword arguments, ``addmm``'s factors),
  each x every fp8-family rule x eager / checkpointed x interleaved policies;
- whatever computes the weight: torch's parametrizations (orthogonal under each map, spectral and
  weight norm, new and old style), custom parametrizations with matmuls and a fresh ``torch.eye``
  inside, a weight computed inline with a constant: those matmuls are not served and the one that
  consumes the weight is;
- matmul-like ops the recipes cannot run with a weight operand: a ConfigError naming the module
  and the op, also when the module served an ``F.linear`` in the same forward.

A compiled subset (aot_eager) runs through the same harness.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.parametrize as parametrize
from tests.fp8_harness import (
    BF16,
    COMPILE_WARNING,
    HOWS,
    RULES,
    D,
    Linear,
    assert_not_plain,
    compile_once,
    interleaved,
    make_input,
    refused,
    unique_graphs,
)
from torch import nn
from torch.nn.utils import parametrizations
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

import mixprec
from mixprec.errors import ConfigError

Fn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Oracle = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Linear], torch.Tensor]


# ---------------------------------------------------------------- spellings
@dataclass(frozen=True)
class Spelling:
    """``run(x, W, b)`` spells a Linear's forward; ``oracle(x, W, b, lin)`` is what it must be."""

    run: Fn
    oracle: Oracle


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, lin: Linear) -> torch.Tensor:
    return lin(x, w, b)


def _plus_bias(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, lin: Linear) -> torch.Tensor:
    return lin(x, w, None) + b


def _flat(fn: Fn) -> Fn:
    """A spelling for 2-D inputs, run on the harness's 3-D input flattened."""
    return lambda x, w, b: fn(x.reshape(-1, D), w, b).view(*x.shape[:-1], -1)


def _rows(fn: Fn) -> Fn:
    """A spelling for one 1-D input row, run on each row (``mv``, ``addmv``)."""
    return lambda x, w, b: torch.stack([fn(r, w, b) for r in x.reshape(-1, D)]).view(
        *x.shape[:-1], -1
    )


def _rows_oracle(oracle: Oracle) -> Oracle:
    def each(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, lin: Linear) -> torch.Tensor:
        return torch.stack([oracle(r, w, b, lin) for r in x.reshape(-1, D)]).view(*x.shape[:-1], -1)

    return each


def _scaled(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, lin: Linear) -> torch.Tensor:
    return lin(x, w, None) * 2.0 + b.to(BF16) * 0.5


S = Spelling
SPELLINGS: dict[str, Spelling] = {
    "F.linear": S(lambda x, w, b: F.linear(x, w, b), _linear),
    "F.linear(input=,weight=,bias=)": S(
        lambda x, w, b: F.linear(input=x, weight=w, bias=b), _linear
    ),
    "F.linear(x,weight=,bias=)": S(lambda x, w, b: F.linear(x, weight=w, bias=b), _linear),
    "x@W.t()": S(lambda x, w, b: x @ w.t() + b, _plus_bias),
    "W.t().__rmatmul__(x)": S(lambda x, w, b: w.t().__rmatmul__(x) + b, _plus_bias),
    "(W@x.mT).mT": S(lambda x, w, b: (w @ x.mT).mT + b, _plus_bias),
    "torch.matmul": S(lambda x, w, b: torch.matmul(x, w.t()) + b, _plus_bias),
    "torch.matmul(input=,other=)": S(
        lambda x, w, b: torch.matmul(input=x, other=w.t()) + b, _plus_bias
    ),
    "torch.matmul(W,x.mT)": S(lambda x, w, b: torch.matmul(w, x.mT).mT + b, _plus_bias),
    "torch.linalg.matmul": S(lambda x, w, b: torch.linalg.matmul(x, w.t()) + b, _plus_bias),
    "torch.linalg.matmul(input=,other=)": S(
        lambda x, w, b: torch.linalg.matmul(input=x, other=w.t()) + b, _plus_bias
    ),
    "x.matmul": S(lambda x, w, b: x.matmul(w.t()) + b, _plus_bias),
    "x.matmul(other=)": S(lambda x, w, b: x.matmul(other=w.t()) + b, _plus_bias),
    "torch.mm": S(_flat(lambda x, w, b: torch.mm(x, w.t()) + b), _plus_bias),
    "torch.mm(input=,mat2=)": S(
        _flat(lambda x, w, b: torch.mm(input=x, mat2=w.t()) + b), _plus_bias
    ),
    "x.mm(mat2=)": S(_flat(lambda x, w, b: x.mm(mat2=w.t()) + b), _plus_bias),
    "torch.mv(W,row)": S(_rows(lambda r, w, b: torch.mv(w, r) + b), _rows_oracle(_plus_bias)),
    "torch.mv(input=,vec=)": S(
        _rows(lambda r, w, b: torch.mv(input=w, vec=r) + b), _rows_oracle(_plus_bias)
    ),
    "W.mv(row)": S(_rows(lambda r, w, b: w.mv(r) + b), _rows_oracle(_plus_bias)),
    "torch.addmm": S(_flat(lambda x, w, b: torch.addmm(b, x, w.t())), _linear),
    "torch.addmm(input=,mat1=,mat2=)": S(
        _flat(lambda x, w, b: torch.addmm(input=b, mat1=x, mat2=w.t())), _linear
    ),
    "b.addmm(mat1=,mat2=)": S(_flat(lambda x, w, b: b.addmm(mat1=x, mat2=w.t())), _linear),
    "torch.addmm(beta=,alpha=)": S(
        _flat(lambda x, w, b: torch.addmm(b, x, w.t(), beta=0.5, alpha=2.0)), _scaled
    ),
    "torch.addmv(b,W,row)": S(_rows(lambda r, w, b: torch.addmv(b, w, r)), _rows_oracle(_linear)),
    "b.addmv(mat=,vec=)": S(_rows(lambda r, w, b: b.addmv(mat=w, vec=r)), _rows_oracle(_linear)),
}


class Spelled(nn.Linear):
    def __init__(self, spelling: str) -> None:
        super().__init__(D, D)
        self.spelling = SPELLINGS[spelling]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.spelling.run(x, self.weight, self.bias)

    def oracle(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        return self.spelling.oracle(x, self.weight, self.bias, lin)


class Holder(nn.Module):
    """The root: the module under test is its ``m``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.m = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.m(x)

    def oracle(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        return self.m.oracle(x, lin)  # type: ignore[operator]


def _class_rule(rule: str) -> str:
    return f"nn.Linear={rule}"


def _spelled(name: str) -> Callable[[], nn.Module]:
    return lambda: Holder(Spelled(name))


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_each_spelling_is_served_as_the_oracle(spelling: str, how: str) -> None:
    for rule in RULES:
        interleaved(_spelled(spelling), _class_rule, rule, how)


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_the_spellings_oracle_is_not_the_plain_region(spelling: str) -> None:
    assert_not_plain(_spelled(spelling))


# ---------------------------------------------------------------- whatever computes the weight
class EyeGram(nn.Module):
    """A custom parametrization with matmuls and a fresh ``torch.eye`` inside (as the cayley
    map has), through ``torch.linalg.matmul`` and ``@``."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        eye = torch.eye(w.shape[0], dtype=w.dtype, device=w.device)
        return torch.linalg.matmul(eye * 0.5 + w @ w.t() / w.shape[0], w)


class LowRank(nn.Module):
    """A custom parametrization with parameters of its own: ``W + B @ A`` by ``torch.mm``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(4, D) / D)
        self.b = nn.Parameter(torch.randn(D, 4) / 4)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w + torch.mm(self.b, self.a)


class Projected(nn.Module):
    """A custom parametrization multiplying by a plain tensor attribute (neither a parameter, a
    buffer nor a constant made in the forward): inside a parametrization it computes the
    weight all the same."""

    def __init__(self) -> None:
        super().__init__()
        self.p = torch.eye(D) + torch.randn(D, D) / D

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return self.p @ w


def _custom(parametrization: Callable[[], nn.Module]) -> Callable[[nn.Linear], nn.Linear]:
    def apply(lin: nn.Linear) -> nn.Linear:
        parametrize.register_parametrization(lin, "weight", parametrization())
        return lin

    return apply


class Reparametrized(nn.Module):
    """``fc``, a Linear whose weight ``apply`` reparametrized (``eval``: the spectral norms'
    power iteration would change the weight at each read)."""

    def __init__(self, apply: Callable[[nn.Linear], nn.Module], out: int = D) -> None:
        super().__init__()
        self.fc = apply(nn.Linear(D, out))
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)

    def oracle(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        return lin(x, self.fc.weight, self.fc.bias)


class OldStyle(nn.Module):
    """``fc`` under the hook-based spectral or weight norm (the weight computed by a forward
    pre-hook of the Linear's own, inside its scope); the oracle recomputes it by the hook's own
    function."""

    def __init__(self, spectral: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        if spectral:
            self.norm: SpectralNorm | WeightNorm = SpectralNorm.apply(
                self.fc, "weight", 1, 0, 1e-12
            )
        else:
            self.norm = WeightNorm.apply(self.fc, "weight", 0)
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)

    def oracle(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        if isinstance(self.norm, SpectralNorm):
            weight = self.norm.compute_weight(self.fc, do_power_iteration=False)
        else:
            weight = self.norm.compute_weight(self.fc)
        return lin(x, weight, self.fc.bias)


class InlineEye(nn.Linear):
    """The weight computed in the forward itself from a constant: ``W @ (I + delta)``."""

    def __init__(self) -> None:
        super().__init__(D, D)
        self.delta = nn.Parameter(torch.randn(D, D) / D)

    def computed(self) -> torch.Tensor:
        return self.weight @ (torch.eye(D) + self.delta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.computed(), self.bias)

    def oracle(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        return lin(x, self.computed(), self.bias)


def _orthogonal(orthogonal_map: str) -> Callable[[nn.Linear], nn.Module]:
    return lambda lin: parametrizations.orthogonal(lin, orthogonal_map=orthogonal_map)


COMPUTED: dict[str, Callable[[], nn.Module]] = {
    "orthogonal-cayley": lambda: Reparametrized(_orthogonal("cayley")),
    "orthogonal-cayley-rectangular": lambda: Reparametrized(_orthogonal("cayley"), 2 * D),
    "orthogonal-matrix_exp": lambda: Reparametrized(_orthogonal("matrix_exp")),
    "orthogonal-householder": lambda: Reparametrized(_orthogonal("householder")),
    "spectral_norm": lambda: Reparametrized(parametrizations.spectral_norm),
    "weight_norm": lambda: Reparametrized(parametrizations.weight_norm),
    "spectral_norm-old-style": lambda: OldStyle(spectral=True),
    "weight_norm-old-style": lambda: OldStyle(spectral=False),
    "custom-eye-gram": lambda: Reparametrized(_custom(EyeGram)),
    "custom-low-rank": lambda: Reparametrized(_custom(LowRank)),
    "custom-plain-tensor": lambda: Reparametrized(_custom(Projected)),
    "inline-eye": lambda: Holder(InlineEye()),
}


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")
@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("form", list(COMPUTED))
def test_the_matmul_consuming_a_computed_weight_is_served(form: str, how: str) -> None:
    """Bitwise the oracle: the matmuls computing the weight ran as written (had one been served,
    the weight would differ), the one consuming it was served."""
    for rule in RULES:
        interleaved(COMPUTED[form], _class_rule, rule, how)


# torch cannot deepcopy a Linear under the hook-based weight_norm (its weight attribute is no
# graph leaf), which the check needs; its oracle reads the same weight as "weight_norm"'s.
_COPYABLE = [f for f in COMPUTED if f != "weight_norm-old-style"]


@pytest.mark.parametrize("form", _COPYABLE)
def test_the_computed_forms_oracle_is_not_the_plain_region(form: str) -> None:
    assert_not_plain(COMPUTED[form])


@pytest.mark.parametrize(
    "form", ["orthogonal-cayley", "custom-eye-gram", "custom-plain-tensor", "inline-eye"]
)
def test_only_the_consuming_matmul_is_recorded(form: str) -> None:
    """One record, under the Linear's name, with the input's elements: nothing of the matmuls
    computing the weight (the parametrization's own modules are not served)."""
    model = COMPUTED[form]()
    linear = next(n for n, m in model.named_modules() if isinstance(m, nn.Linear))
    x = make_input(1)
    stats = mixprec.Fp8Stats()
    with stats, mixprec.autocast("cpu", BF16, policy="nn.Linear=mxfp8"):
        model(x)
    assert stats.names == [linear]
    assert stats.read()[linear].input.elements == x.numel()


# ---------------------------------------------------------------- refused ops
def _both(extra: Fn) -> Fn:
    """An ``F.linear`` served first, then ``extra`` on the same weight in the same forward."""
    return lambda x, w, b: F.linear(x, w, b) + extra(x, w, b)


def _batched(w: torch.Tensor) -> torch.Tensor:
    return w.t().expand(2, D, D)


UNSERVABLE: dict[str, Fn] = {
    "F.conv1d": lambda x, w, b: F.conv1d(x.mT, w[:, :, None]).mT,
    "F.conv2d": lambda x, w, b: F.conv2d(x.mT[..., None], w[:, :, None, None])[..., 0].mT,
    "F.conv_transpose1d": lambda x, w, b: F.conv_transpose1d(x.mT, w[:, :, None]).mT,
    "torch.einsum": lambda x, w, b: torch.einsum("...i,oi->...o", x, w),
    "torch.bmm": lambda x, w, b: torch.bmm(x, _batched(w)),
    "Tensor.bmm": lambda x, w, b: x.bmm(_batched(w)),
    "torch.baddbmm": lambda x, w, b: torch.baddbmm(x, x, _batched(w)),
    "torch.tensordot": lambda x, w, b: torch.tensordot(x, w, dims=([2], [1])),
    "torch.linalg.vecdot": lambda x, w, b: torch.linalg.vecdot(x[..., None, :], w),
    "torch.inner": lambda x, w, b: torch.inner(x, w),
    "torch.outer": lambda x, w, b: torch.outer(x[0, 0], w[0]).sum(),
    "torch.dot": lambda x, w, b: torch.dot(x[0, 0], w[0]),
    "torch.kron": lambda x, w, b: torch.kron(x[0], w).sum(),
    "torch.linalg.multi_dot": lambda x, w, b: torch.linalg.multi_dot([x[0], w.t(), w.t()]),
    "F.scaled_dot_product_attention": lambda x, w, b: F.scaled_dot_product_attention(
        x, _batched(w), _batched(w)
    ),
    "torch.mm with out=": _flat(lambda x, w, b: torch.mm(x, w.t(), out=torch.empty(8, D))),
}


class Unservable(nn.Linear):
    def __init__(self, op: str) -> None:
        super().__init__(D, D)
        self.op = _both(UNSERVABLE[op])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.weight, self.bias)


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("op", list(UNSERVABLE))
def test_an_unservable_op_on_the_weight_is_refused_naming_module_and_op(op: str, how: str) -> None:
    label = op.replace(" with out=", ".*out=")
    for rule in RULES:
        refused(lambda: Holder(Unservable(op)), _class_rule, rule, how, rf"module 'm'.*{label}")


def test_a_convolution_under_a_container_rule_is_refused_naming_it() -> None:
    block = nn.Sequential(nn.Linear(D, D), nn.Unflatten(-1, (D, 1)), nn.Conv1d(D, D, 1))
    refused = pytest.raises(ConfigError, match=r"module '0\.2'.*F\.conv1d")
    with refused, mixprec.autocast("cpu", BF16, policy="0=fp8"):
        nn.Sequential(block)(torch.randn(4, D))


# ---------------------------------------------------------------- compiled
COMPILED_SPELLINGS = [
    "torch.linalg.matmul(input=,other=)",
    "torch.mm(input=,mat2=)",
    "torch.addmm(beta=,alpha=)",
    "W.t().__rmatmul__(x)",
]
COMPILED_FORMS = ["orthogonal-cayley", "custom-eye-gram", "custom-plain-tensor", "inline-eye"]


@pytest.mark.slow
@pytest.mark.filterwarnings(COMPILE_WARNING)
@pytest.mark.parametrize("case", COMPILED_SPELLINGS + COMPILED_FORMS)
def test_compiled_spellings_and_computed_weights_are_served(case: str) -> None:
    """One compiled wrapper (aot_eager) per case, two rules through it."""
    make = _spelled(case) if case in SPELLINGS else COMPUTED[case]
    cases = COMPILED_SPELLINGS + COMPILED_FORMS
    rule = list(RULES)[cases.index(case) % len(RULES)]
    before = unique_graphs()
    interleaved(make, _class_rule, rule, "eager", wrap=compile_once())
    assert unique_graphs() > before  # it did compile


@pytest.mark.slow
@pytest.mark.filterwarnings(COMPILE_WARNING)
@pytest.mark.parametrize("op", ["F.conv1d", "torch.linalg.vecdot", "torch.einsum"])
def test_compiled_unservable_ops_are_refused(op: str) -> None:
    refused(
        lambda: Holder(Unservable(op)),
        _class_rule,
        "fp8",
        "eager",
        rf"module 'm'.*{op}",
        wrap=compile_once(),
    )
