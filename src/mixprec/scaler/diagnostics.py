"""The text of actionable messages: what happened, which parameters, what to do."""

from __future__ import annotations

from collections.abc import Sequence

from mixprec.kernels.plan import ParamRef

__all__ = [
    "describe_params",
    "low_precision_message",
    "no_inf_checks_message",
    "no_scale_message",
]

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
        "you), or keep fp32 master copies of the fp16 parameters and give those to the "
        "optimizer. Frozen parameters (requires_grad=False) may stay fp16."
    )


def no_inf_checks_message(context: str, missing: Sequence[ParamRef]) -> str:
    """``step`` or ``update`` found nothing checked for inf/NaN."""
    if missing:
        detail = (
            f"None of the optimizer's {len(missing)} parameter(s) has a .grad: "
            f"{describe_params(missing)}."
        )
    else:
        detail = "The optimizer has no parameters."
    return (
        f"No inf checks were recorded {context}. {detail} Make sure the loss was scaled and "
        "backward() ran before step() (scaler.scale(loss).backward()), that the optimizer was "
        "built from the parameters of the model that produced the loss, and that those "
        "parameters are used in the forward pass."
    )
