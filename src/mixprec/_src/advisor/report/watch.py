"""What a check of :class:`mixprec.Watch` reports: the records of the modules it measured, the
alerts, and the proposals (the advisor's search again; a phase switch), and the warning's text."""

from __future__ import annotations

from dataclasses import dataclass

from mixprec._src.advisor.report.advice import Measurement, ModuleAdvice
from mixprec._src.autocast.policy import Policy


@dataclass(frozen=True)
class WatchRecord:
    """One module measured at one check.

    Attributes:
        step: the training step (the count of :meth:`Watch.step` calls).
        name: the module's qualified name.
        candidate: the precision it was measured in (its choice in the policy).
        model_grad_sqnr: the whole-model gradient SQNR with only this module in ``candidate``
            (dB; higher is better), as the advisor measures it.
        reference_sqnr: the same with the module in the region's 16-bit dtype instead, when
            this check measured it (None: not measured, or ``candidate`` is itself 16-bit).
        output_sqnr: the SQNR of the module's own output in ``candidate`` (dB).
        saturated: fp8: the largest fraction of values at the format's maximum over the
            module's operands; None for 16-bit.
        flushed: fp8: the largest fraction of non-zero values flushed to 0; None for 16-bit.
        clipped: fp8: the largest fraction of an operand's blocks whose scale hit the top of
            its format, so that their values clip; None for 16-bit.
    """

    step: int
    name: str
    candidate: str
    model_grad_sqnr: float
    reference_sqnr: float | None
    output_sqnr: float
    saturated: float | None
    flushed: float | None
    clipped: float | None = None

    @property
    def margin(self) -> float | None:
        """How far ``candidate`` is below 16-bit at this step (dB), None when not measured.

        Host sync: none.
        """
        if self.reference_sqnr is None:
            return None
        return self.reference_sqnr - self.model_grad_sqnr


@dataclass(frozen=True)
class WatchReport:
    """What one check measured and concluded.

    Attributes:
        step: the training step of the check.
        records: one per module measured at this check.
        predicted_sqnr: the advice's prediction with each module's figure lowered by the
            margin it lost since the watch first measured it.
        alerts: why the policy looks stale, one sentence per module (empty: all is well).
        policy: with alerts, the proposal the latest figures give (the advisor's search);
            None when nothing changes.
        switch: when a module lost ground against 16-bit: the policy in force with that
            module's fprop matmul in the region's 16-bit dtype (a phase switch: late in
            training the forward is where low precision costs most); None otherwise.
        applied: with ``apply=True``, what the switch changed in the schedule, from the next
            step on (``"name: old rule -> new rule"``); empty otherwise.
    """

    step: int
    records: tuple[WatchRecord, ...]
    predicted_sqnr: float
    alerts: tuple[str, ...]
    policy: Policy | None
    switch: Policy | None = None
    applied: tuple[str, ...] = ()


def _saturation(m: Measurement | None) -> float | None:
    if m is None or m.fp8 is None:
        return None
    return max(m.fp8.input.saturated, m.fp8.weight.saturated, m.fp8.grad_output.saturated)


def clipped(m: Measurement | None) -> float | None:
    if m is None or m.fp8 is None:
        return None
    fp8 = m.fp8
    return max(
        fp8.input.block_saturated, fp8.weight.block_saturated, fp8.grad_output.block_saturated
    )


def flushed(m: Measurement | None) -> float | None:
    if m is None or m.fp8 is None:
        return None
    return max(m.fp8.input.flushed, m.fp8.weight.flushed, m.fp8.grad_output.flushed)


def record(step: int, row: ModuleAdvice, m: Measurement, ref: Measurement | None) -> WatchRecord:
    return WatchRecord(
        step,
        row.name,
        m.candidate,
        m.model_grad_sqnr,
        None if ref is None else ref.model_grad_sqnr,
        m.output_sqnr,
        _saturation(m),
        flushed(m),
        clipped(m),
    )


def message(report: WatchReport) -> str:
    text = f"mixprec.Watch at step {report.step}: " + "; ".join(report.alerts)
    if report.policy is not None:
        text += f". The latest figures propose: {report.policy}"
    if report.applied:
        text += ". Applied to the schedule: " + "; ".join(report.applied)
    elif report.switch is not None:
        text += f". A phase switch would run their forward in 16-bit: {report.switch}"
    return text
