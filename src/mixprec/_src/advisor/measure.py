"""What each pass measures: isolated modules, float16 ranges, the region, a policy."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mixprec._src.advisor.candidates import Candidate
from mixprec._src.advisor.engine import Engine, Target
from mixprec._src.advisor.metrics import fp16_flushed, fp16_overflows
from mixprec._src.advisor.report import Fp16Range, Measurement
from mixprec._src.advisor.taps import Tap
from mixprec._src.autocast.policy import Policy
from mixprec._src.autocast.region import autocast
from mixprec._src.fp8.stats import Fp8Stats


def isolated(engine: Engine, target: Target, cand: Candidate) -> Measurement:
    """Run ``target`` alone in ``cand`` (the rest in float32) and compare with the reference."""
    tap = Tap(target.module, against=target.record, scale=engine.scale)
    stats = Fp8Stats() if cand.recipe is not None else None
    make = cand.isolated(target.module, target.name, engine.device_type, engine.job.region, stats)
    grads = engine.run(f"{target.name} in {cand.word}", [tap], isolate=(target.module, make))
    has_input_grads = any(any(g is not None for g in call) for call in target.record.input_grads)
    weight = engine.subset_power(grads, target.param_index) if target.param_index else None
    return Measurement(
        candidate=cand.word,
        model_grad_sqnr=engine.model_power(grads).sqnr,
        output_sqnr=tap.comparison.output.sqnr,
        input_grad_sqnr=tap.comparison.input_grad.sqnr if has_input_grads else None,
        weight_grad_sqnr=None if weight is None else weight.sqnr,
        fp8=None if stats is None else stats.read().get(target.name),
    )


def with_policy(engine: Engine, label: str, policy: Policy | None) -> float:
    """Whole-model gradient SQNR with the model in the region under ``policy``."""
    device_type, dtype = engine.device_type, engine.job.region

    def region() -> autocast:
        return autocast(device_type, dtype=dtype, policy=policy)

    return engine.model_power(engine.run(label, region=region)).sqnr


def fp16_range(target: Target, grads: Sequence[torch.Tensor | None], scale: float) -> Fp16Range:
    """A target's float16 range figures from the reference pass."""
    outs = [o for call in target.record.outputs for o in call]
    tensors = [grads[i] for i in target.param_index]
    for calls in (target.record.output_grads, target.record.input_grads):
        tensors += [g for call in calls for g in call]
    present = [g for g in tensors if g is not None and g.numel()]
    flushed = [0, 0, 0]  # unscaled, scaled, non-zero
    overflow = 0
    for g in present:
        a, n = fp16_flushed(g)
        b, _ = fp16_flushed(g, scale)
        flushed[0], flushed[1], flushed[2] = flushed[0] + a, flushed[1] + b, flushed[2] + n
        overflow += fp16_overflows(g, scale)
    nonzero = max(flushed[2], 1)
    return Fp16Range(
        output_overflow=sum(fp16_overflows(o) for o in outs),
        output_max=max((float(o.abs().max()) for o in outs if o.numel()), default=0.0),
        grad_max=max((float(g.abs().max()) for g in present), default=0.0),
        flushed_unscaled=flushed[0] / nonzero,
        flushed_scaled=flushed[1] / nonzero,
        grad_overflow_scaled=overflow,
    )


def overflow_detail(fp16: Fp16Range | None) -> str | None:
    """Why float16 fails on a module, when its range figures say so."""
    if fp16 is None:
        return None
    if fp16.output_overflow:
        return (
            f"{fp16.output_overflow} outputs above the fp16 max 65504, "
            f"largest {fp16.output_max:.3g}"
        )
    if fp16.grad_overflow_scaled:
        return f"{fp16.grad_overflow_scaled} gradients overflow fp16 at the proposed scale"
    return None
