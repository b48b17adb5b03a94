"""The text of actionable messages: what happened, which parameters, what to do."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from mixprec._src.kernels.plan import ParamRef, iter_params

_MAX_LISTED = 8


def describe_params(refs: Sequence[ParamRef]) -> str:
    """A comma-separated list of at most eight parameters, then a count of the rest."""
    names = [ref.describe() for ref in refs[:_MAX_LISTED]]
    more = len(refs) - len(names)
    if more > 0:
        names.append(f"and {more} more")
    return ", ".join(names)


def no_scale_message(method: str) -> str:
    """A method that needs the scale was called before any ``scale()``."""
    return (
        f"{method}() was called before scaler.scale(): the scale does not exist yet. Call "
        "scaler.scale(loss).backward() earlier in the iteration (the scale is created on the "
        "device of the first scaled output)."
    )


def low_precision_message(refs: Sequence[ParamRef]) -> str:
    """fp16 gradients cannot be unscaled in place without losing them."""
    return (
        f"Attempting to unscale FP16 gradients of {len(refs)} parameter(s): "
        f"{describe_params(refs)}. Unscaling fp16 gradients in place flushes small values to "
        "zero and the optimizer would update fp16 weights, losing small updates. Keep trainable "
        "parameters in float32 (do not call model.half(); autocast runs the ops in fp16 for "
        "you), or, to train fp16 parameters, wrap the optimizer with "
        "mixprec.MasterWeights(optimizer) before its first step: it keeps fp32 master copies "
        "that the scaler unscales and the optimizer updates. Frozen parameters "
        "(requires_grad=False) may stay fp16."
    )


def no_inf_checks_message(context: str, missing: Sequence[ParamRef], *optimizers: object) -> str:
    """``step`` or ``update`` found nothing checked for inf/NaN; says why, truly."""
    if missing:
        detail = (
            f"None of the optimizer's {len(missing)} parameter(s) has a .grad: "
            f"{describe_params(missing)}."
        )
    else:
        groups = [g for o in optimizers for g in getattr(o, "param_groups", [])]
        count = sum(len(g["params"]) for g in groups)
        if count == 0:
            detail = "The optimizer has no parameters."
        else:
            detail = (
                f"Its {count} parameter(s) were never checked: an optimizer written to torch's "
                "legacy fused contract (step(closure=None, grad_scaler=None)) must call "
                "grad_scaler._check_inf_per_device(self) in its step()."
            )
    return (
        f"No inf checks were recorded {context}. {detail} Make sure the loss was scaled and "
        "backward() ran before step() (scaler.scale(loss).backward()), that the optimizer was "
        "built from the parameters of the model that produced the loss, and that those "
        "parameters are used in the forward pass."
    )


@dataclass(frozen=True)
class Diagnosis:
    """Parameters whose gradients are non-finite or missing, by optimizer.

    Attributes:
        non_finite: names (or positions) of parameters whose grad holds inf or NaN.
        missing: names (or positions) of parameters without a grad.
    """

    non_finite: list[str]
    missing: list[str]

    @property
    def healthy(self) -> bool:
        """True when every parameter has a finite grad."""
        return not self.non_finite and not self.missing

    def __str__(self) -> str:
        if self.healthy:
            return "All gradients are present and finite."
        lines = []
        if self.non_finite:
            lines.append(f"{len(self.non_finite)} parameter(s) with inf/NaN gradients:")
            lines.extend(f"  - {name}" for name in self.non_finite)
        if self.missing:
            lines.append(f"{len(self.missing)} parameter(s) without a gradient:")
            lines.extend(f"  - {name}" for name in self.missing)
        return "\n".join(lines)


def diagnose_optimizers(optimizers: Iterable[torch.optim.Optimizer]) -> Diagnosis:
    """Check every grad of ``optimizers`` (one host sync for all of them)."""
    refs, flags, missing = [], [], []
    for optimizer in optimizers:
        for ref in iter_params(optimizer):
            grad = ref.param.grad
            if grad is None:
                missing.append(ref.describe())
                continue
            values = grad._values() if grad.is_sparse else grad
            refs.append(ref)
            flags.append(torch.isfinite(values).all().to("cpu", non_blocking=True))
    finite = torch.stack(flags).tolist() if flags else []
    bad = [ref.describe() for ref, ok in zip(refs, finite, strict=True) if not ok]
    return Diagnosis(non_finite=bad, missing=missing)


def collapse_message(what: str, scale: float, skips: int, diagnosis: Diagnosis | None) -> str:
    """Why training stopped making progress, and what usually causes it."""
    offenders = "The parameters could not be inspected (their optimizers are gone)."
    if diagnosis is not None and diagnosis.non_finite:
        offenders = (
            f"Non-finite gradients now: {', '.join(diagnosis.non_finite[:_MAX_LISTED])}"
            + (" ..." if len(diagnosis.non_finite) > _MAX_LISTED else "")
            + "."
        )
    elif diagnosis is not None:
        offenders = "No parameter holds a non-finite gradient right now."
    return (
        f"{what} (scale {scale:g}, {skips} consecutive skipped iteration(s)). {offenders} "
        "Likely causes: an fp16 overflow in the forward pass (a loss or activation beyond "
        "65504: look for the first non-finite module output, or run that module in fp32), a "
        "model pretrained in bf16 whose values do not fit fp16 (train in bfloat16 instead), or "
        "a learning rate that makes training diverge (lower it, or clip gradients)."
    )
