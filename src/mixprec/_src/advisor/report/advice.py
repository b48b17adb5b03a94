"""The advisor's report: value types, their JSON form, and the entry points to table and plot."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mixprec._src.advisor.speed.model import Gemms, StepTime, Time
from mixprec._src.autocast.policy import Policy
from mixprec._src.autocast.rules import format_dtype
from mixprec._src.fp8.stats import Fp8ModuleStats
from mixprec.errors import ConfigError

if TYPE_CHECKING:
    from mixprec._src.advisor.report.export import TorchaoExport, TorchtitanExport


@dataclass(frozen=True)
class Measurement:
    """One module in one candidate precision, the rest of the model in float32.

    SQNRs are in dB against the float32 reference (``inf``: no error; ``-inf``: inf or NaN).

    Attributes:
        candidate: the candidate's rule word (``"fp16"``, ``"bf16"``, ...).
        model_grad_sqnr: SQNR of the whole model's parameter gradient with only this module in
            the candidate precision: the module's impact, which the proposal adds up.
        output_sqnr: SQNR of the module's outputs.
        input_grad_sqnr: SQNR of the gradient of the module's inputs (None: no input needs one).
        weight_grad_sqnr: SQNR of the gradient of the module's own parameters (None: none).
        fp8: for an fp8 candidate, the module's fp8 cast statistics per operand (amax, scale,
            saturated and flushed fractions, non-finite count), else None.
        time: with a ``gpu``, the module's predicted time per step in this candidate on
            that GPU (its three GEMMs and its casts); None without a GPU, for a module
            without a GEMM, or where the GPU cannot run the candidate.
        matmuls: a recipe measured per matmul (``advise(..., per_matmul=True)``): the
            whole-model gradient SQNR with only that matmul of the module in the recipe,
            ``(fprop, dgrad, wgrad)`` (dB), from two passes: fprop in the recipe with the other
            two in float32 (the module's input and output in the region's dtype, counted in
            fprop's figure; this pass gives ``output_sqnr``), then an exact forward with dgrad
            and wgrad in the recipe (their errors reach different gradients: dgrad's those of
            everything upstream, wgrad's the module's own weight; that pass gives
            ``input_grad_sqnr`` and ``weight_grad_sqnr``). ``model_grad_sqnr`` is then the
            three errors added. A module whose input needs no gradient runs no dgrad: inf. A
            module whose weight is tied to another's gets a pass for dgrad and one for wgrad.
            None: the module measured whole, in one pass.
    """

    candidate: str
    model_grad_sqnr: float
    output_sqnr: float
    input_grad_sqnr: float | None
    weight_grad_sqnr: float | None
    fp8: Fp8ModuleStats | None = None
    time: Time | None = None
    matmuls: tuple[float, float, float] | None = None

    @property
    def finite(self) -> bool:
        """Whether the module's outputs and gradients stayed finite. Host sync: none."""
        values = (self.model_grad_sqnr, self.output_sqnr, self.input_grad_sqnr)
        return all(v is None or v != -math.inf for v in (*values, self.weight_grad_sqnr))


@dataclass(frozen=True)
class Fp16Range:
    """How a module's float32 reference values fit the float16 range.

    Attributes:
        output_overflow: output values of magnitude above 65504 (float16 makes them inf).
        output_max: the largest output magnitude.
        grad_max: the largest magnitude of the module's output, input and weight gradients.
        flushed_unscaled: fraction of the non-zero gradients that float16 rounds to zero
            without loss scaling.
        flushed_scaled: the same with the proposed ``init_scale``.
        grad_overflow_scaled: gradient values that overflow float16 at the proposed scale.
    """

    output_overflow: int
    output_max: float
    grad_max: float
    flushed_unscaled: float
    flushed_scaled: float
    grad_overflow_scaled: int


@dataclass(frozen=True)
class ModuleAdvice:
    """One measured module: what it is, how each candidate did, what was decided and why.

    Attributes:
        name: qualified name in the model (``model.named_modules()``).
        kind: class name.
        params: number of parameter elements the module owns (with its children).
        calls: how many times it ran per pass.
        measurements: one per candidate that can serve it, in candidate order.
        fp16: its float16 range figures (None unless ``"fp16"`` is a candidate).
        choice: the rule word it gets in the proposal (a candidate, or the kept precision).
        reason: why, in a few words.
        kept_measurement: when the module is kept in the region's 16-bit dtype (around fp8
            candidates), its measurement in that dtype, which the prediction includes.
        served: whether any candidate can serve the module (fp8 recipes serve ``nn.Linear``);
            an unserved module gets no rule and runs as the region runs it: it is not kept.
        kept_time: with a ``gpu``, its predicted time in the kept precision.
        chosen: when the choice is a rule per matmul (``"nvfp4/nvfp4/bf16"``: not one of the
            candidates measured), its figures as the prediction adds them up from the matmuls
            measured alone (``model_grad_sqnr``, ``matmuls``; with a GPU its ``time``); the
            other tensor figures are not measured (NaN). None otherwise.
        gemms: the module's GEMMs per call, as the reference pass saw them (what the speed
            model times); None for a module without one.
    """

    name: str
    kind: str
    params: int
    calls: int
    measurements: tuple[Measurement, ...]
    fp16: Fp16Range | None
    choice: str
    reason: str
    kept_measurement: Measurement | None = None
    served: bool = True
    kept_time: Time | None = None
    chosen: Measurement | None = None
    gemms: Gemms | None = None

    @property
    def time(self) -> Time | None:
        """Its predicted time in the proposal (None without a GPU). Host sync: none."""
        if self.chosen is not None:
            return self.chosen.time
        if not self.served or self.choice not in self.candidates:
            return self.kept_time
        chosen = self.measurement(self.choice)
        return None if chosen is None else chosen.time

    @property
    def candidates(self) -> tuple[str, ...]:
        """The candidates measured on it. Host sync: none."""
        return tuple(m.candidate for m in self.measurements)

    def measurement(self, candidate: str) -> Measurement | None:
        """The measurement for ``candidate`` (None if that candidate cannot serve the module);
        for the chosen rule per matmul, its predicted figures (:attr:`chosen`).

        Host sync: none.
        """
        if self.chosen is not None and self.chosen.candidate == candidate:
            return self.chosen
        return next((m for m in self.measurements if m.candidate == candidate), None)


@dataclass(frozen=True)
class Cheapest:
    """Every measured module in its cheapest finite candidate: the additive model's own check.

    The prediction adds the modules' errors as if they were independent. Measuring one policy,
    the cheapest, says how far that holds on this model and batch: ``error`` near 0 (an MLP, a
    transformer: within 0.6 dB in docs/advisor.md) means the predictions can be trusted; a large
    one (a BatchNorm CNN in fp16: the measured SQNR 3-13 dB above the prediction) means they
    are a rough bound, and ``check=True`` is the figure to go by.

    Attributes:
        policy: that policy.
        predicted: its predicted whole-model gradient SQNR (dB).
        measured: its measured one (dB).
    """

    policy: Policy
    predicted: float
    measured: float

    @property
    def error(self) -> float:
        """``measured - predicted`` in dB (positive: the prediction is pessimistic).

        Host sync: none.
        """
        if math.isinf(self.measured) and self.measured == self.predicted:
            return 0.0
        return self.measured - self.predicted


@dataclass(frozen=True)
class Advice:
    """What :func:`mixprec.advise` measured and proposes.

    Apply the proposal with ``mixprec.autocast(advice.device_type, dtype=advice.dtype,
    policy=advice.policy)`` and, when ``advice.init_scale`` is not None (float16 is used),
    ``mixprec.GradScaler(init_scale=advice.init_scale)``.

    Attributes:
        policy: the proposed :class:`mixprec.Policy`; ``Policy(str(advice.policy))`` equals it.
        dtype: the autocast region's dtype for the policy.
        device_type: the device type of the model.
        init_scale: the suggested ``GradScaler`` initial scale (None when float16 is not used).
        kept_precision: what the kept modules run in (``"fp32"``, or ``"bf16"`` around fp8).
        modules: one :class:`ModuleAdvice` per measured module, in the order they first ran.
        candidates: the candidate rule words in the cost order (cheapest first, by bits per
            element; fp16 before bf16), whatever order they were given in.
        min_sqnr: the stated target for the whole-model gradient SQNR (dB), if any.
        keep_at_most: the stated limit on kept modules, if any.
        met: whether the predicted SQNR meets ``min_sqnr`` within the limit.
        predicted_sqnr: the predicted whole-model gradient SQNR of the proposal (dB).
        region_sqnr: the SQNR of the region with every measured module in float32: the error of
            the ops between the measured modules, which no module rule removes.
        measured_sqnr: the SQNR measured with the proposal applied (``check=True``), else None.
        cheapest: every module in its cheapest finite candidate, predicted and measured: how
            far the additive prediction is off on this model (:class:`Cheapest`).
        passes: forward+backward passes over the batches that the advice took.
        notes: anything else worth knowing (modules that did not run, an unmet target).
        gpu: the GPU the speed model predicted for (``"h100"``, ...), or None.
        objective: ``"fewest_kept"`` or ``"speed"`` (what the search chose by).
        step: with a GPU, the predicted time of the step's matmuls, proposal against
            bf16, and where it goes; else None.
        per_matmul: whether each recipe was measured per matmul and the search gave a
            module's three matmuls each their own format (``advise(..., per_matmul=...)``).
        min_speedup: the stated least speedup against bf16 (``objective="sqnr"``), if any.
    """

    policy: Policy
    dtype: torch.dtype
    device_type: str
    init_scale: float | None
    kept_precision: str
    modules: tuple[ModuleAdvice, ...]
    candidates: tuple[str, ...]
    min_sqnr: float | None
    keep_at_most: int | None
    met: bool
    predicted_sqnr: float
    region_sqnr: float
    measured_sqnr: float | None
    cheapest: Cheapest | None
    passes: int
    notes: tuple[str, ...] = field(default=())
    gpu: str | None = None
    objective: str = "fewest_kept"
    step: StepTime | None = None
    per_matmul: bool = False
    min_speedup: float | None = None

    @property
    def kept(self) -> tuple[str, ...]:
        """Names of the modules kept out of every candidate (modules that no candidate can
        serve are not kept: they get no rule). Host sync: none."""
        return tuple(m.name for m in self.modules if m.served and m.choice == self.kept_precision)

    @property
    def matmuls(self) -> dict[str, int]:
        """How many of the measured modules' matmuls (fprop, dgrad, wgrad of each Linear or
        conv) run in each format under the proposal: ``{"nvfp4": 10, "bf16": 17}``; a module
        without a rule counts in the region's dtype. Host sync: none."""
        from mixprec._src.advisor.report.matmuls import matmul_counts

        return matmul_counts(self)

    def table(self, wide: bool = False) -> str:
        """The report as text: a table of each module's model-grad SQNR per candidate and the
        decision, in lines of at most 100 characters (module names wrap), each module's reason
        below it, a legend, the policy, the prediction and the matmuls per format.

        Args:
            wide: the full table instead: also each module's size, output, input-grad and
                weight-grad SQNR per candidate, fp16 range and fp8 cast figures, the reason in
                a column (as wide as it takes).

        Host sync: none.
        """
        from mixprec._src.advisor.report.table import render

        return render(self, wide)

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data (JSON types; infinite SQNRs as the strings ``"inf"`` and
        ``"-inf"``).

        Host sync: none.
        """
        return _jsonable(
            {
                "policy": str(self.policy),
                "dtype": format_dtype(self.dtype),
                "device_type": self.device_type,
                "init_scale": self.init_scale,
                "kept_precision": self.kept_precision,
                "kept": list(self.kept),
                "matmuls": self.matmuls,
                "candidates": list(self.candidates),
                "target": {
                    "min_sqnr": self.min_sqnr,
                    "keep_at_most": self.keep_at_most,
                    "min_speedup": self.min_speedup,
                },
                "met": self.met,
                "predicted_sqnr": self.predicted_sqnr,
                "region_sqnr": self.region_sqnr,
                "measured_sqnr": self.measured_sqnr,
                "cheapest": None if self.cheapest is None else _cheapest_dict(self.cheapest),
                "passes": self.passes,
                "notes": list(self.notes),
                "gpu": self.gpu,
                "objective": self.objective,
                "per_matmul": self.per_matmul,
                "step": None if self.step is None else _step_dict(self.step),
                "modules": [_module_dict(m) for m in self.modules],
            }
        )

    def to_json(self, indent: int | None = 2) -> str:
        """:meth:`to_dict` as a JSON string (the same report gives the same text).

        Host sync: none.
        """
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def to_torchao(self, model: nn.Module) -> TorchaoExport:
        """The advice as ``torchao.float8.convert_to_float8_training`` arguments: one
        conversion per recipe (``config()``, ``module_filter_fn``; ``apply(model)`` runs them)
        and ``not_expressible``: each ruled module torchao.float8 cannot run as advised (a rule
        per matmul, ``mxfp8``, ``nvfp4``, 128-blocks, features not multiples of 16), with why.

        Args:
            model: the model advised (its module names and features).

        Raises:
            ConfigError: a module of the advice is not in ``model``.

        Example:
            >>> import torch, mixprec
            >>> from torch import nn
            >>> model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 16))
            >>> batch = (torch.randn(64, 32), torch.randn(64, 16))
            >>> loss = lambda m, b: nn.functional.mse_loss(m(b[0]), b[1])
            >>> advice = mixprec.advise(model, batch, loss, candidates=["fp8"], per_matmul=False)
            >>> [(c.recipe, c.modules) for c in advice.to_torchao(model).conversions]
            [('tensorwise', ('0', '2'))]

        Host sync: none.
        """
        from mixprec._src.advisor.report.export import to_torchao

        return to_torchao(self, _features(self, model))

    def to_torchtitan(self, model: nn.Module) -> TorchtitanExport:
        """The advice as torchtitan (0.3) converter configs: ``mixprec`` (the fields of
        ``MixprecConverter.Config``: every rule) and, when torchtitan's own
        ``Float8LinearConverter`` expresses it (one rowwise recipe), ``float8`` (its
        ``recipe_name`` and ``filter_fqns``); ``not_expressible`` says what it cannot.

        Raises:
            ConfigError: a module of the advice is not in ``model``.

        Host sync: none.
        """
        from mixprec._src.advisor.report.export import to_torchao, to_torchtitan

        ao = to_torchao(self, _features(self, model))
        linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n]
        return to_torchtitan(self, linears, ao)

    def plot(self, path: str | Path | None = None, *, ax: Any = None) -> Any:
        """Draw each module's gradient SQNR per candidate, the proposal marked (matplotlib).

        Args:
            path: where to write the image (format from the suffix); nothing written if None.
            ax: a matplotlib ``Axes`` to draw into (default: a new figure).

        Returns:
            The matplotlib ``Figure``.

        Raises:
            ImportError: matplotlib is missing (``pip install 'mixprec[plot]'``).

        Host sync: none.
        """
        from mixprec._src.advisor.report.plot import draw

        return draw(self, path, ax)


def _features(advice: Advice, model: nn.Module) -> Callable[[str], tuple[int, int] | None]:
    """``(in_features, out_features)`` by module name (None for a module without them).

    Raises:
        ConfigError: a module of the advice is not in ``model``.
    """
    modules = dict(model.named_modules())
    missing = [m.name for m in advice.modules if m.name not in modules]
    if missing:
        raise ConfigError(
            f"the advice names modules the model does not have ({', '.join(missing[:4])}); "
            "pass the model that was advised"
        )

    def dims(name: str) -> tuple[int, int] | None:
        m = modules[name]
        pair = (getattr(m, "in_features", None), getattr(m, "out_features", None))
        return None if None in pair else (int(pair[0]), int(pair[1]))  # type: ignore[arg-type]

    return dims


def _module_dict(m: ModuleAdvice) -> dict[str, Any]:
    return {
        "name": m.name,
        "kind": m.kind,
        "params": m.params,
        "calls": m.calls,
        "choice": m.choice,
        "reason": m.reason,
        "measurements": [asdict(x) for x in m.measurements],
        "fp16": None if m.fp16 is None else asdict(m.fp16),
        "kept_measurement": None if m.kept_measurement is None else asdict(m.kept_measurement),
        "served": m.served,
        "kept_time": None if m.kept_time is None else asdict(m.kept_time),
        "chosen": None if m.chosen is None else asdict(m.chosen),
        "gemms": None if m.gemms is None else asdict(m.gemms),
    }


def _cheapest_dict(c: Cheapest) -> dict[str, Any]:
    return {
        "policy": str(c.policy),
        "predicted": c.predicted,
        "measured": c.measured,
        "error": c.error,
    }


def _step_dict(step: StepTime) -> dict[str, Any]:
    return {**asdict(step), "speedup": step.speedup}


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
