"""Update hooks that log the scaler: TensorBoard event files and plain ``logging`` lines.

The oracle for the logged scale and skips is ``torch.amp.GradScaler("cpu")`` run side by side
on the same gradients.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch

import mixprec
from mixprec.errors import ConfigError
from mixprec.integrations import LoggingHook, UpdateRecord, WindowedUpdateHook

OVERFLOW_AT = (2, 3, 7)  # 0-based iterations whose fp16 forward overflows


def train(
    hooks: list[WindowedUpdateHook], steps: int = 9
) -> tuple[list[float], list[bool], list[float]]:
    """Train mixprec and torch side by side; return torch's scales after each update, its
    skips, and the grad norms passed to the hooks."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    ref_model = torch.nn.Linear(4, 1)
    ref_model.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.01)
    scaler = mixprec.GradScaler(growth_interval=2)
    ref = torch.amp.GradScaler("cpu", growth_interval=2)
    for hook in hooks:
        hook.attach(scaler)
    scales, skips, norms = [], [], []
    for i in range(steps):
        x = torch.randn(8, 4) * (1e5 if i in OVERFLOW_AT else 1.0)
        for m, o, s in ((model, opt, scaler), (ref_model, ref_opt, ref)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(x).float().pow(2).mean()
            s.scale(loss).backward()
            s.unscale_(o)
            norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 1e6)
            if s is scaler:
                norms.append(float(norm))
                for hook in hooks:
                    hook.record_grad_norm(norm)
            before = s.get_scale()
            s.step(o)
            s.update()
            o.zero_grad()
        scales.append(ref.get_scale())
        skips.append(ref.get_scale() < before)
    return scales, skips, norms


def test_tensorboard_event_files_hold_the_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="needs the [tensorboard] extra")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mixprec.integrations.tensorboard import TensorBoardHook

    hook = TensorBoardHook(tmp_path, prefix="amp/")
    scales, skips, norms = train([hook])
    hook.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()

    def read(tag: str) -> list[float]:
        return [e.value for e in events.Scalars(tag)]

    assert [e.step for e in events.Scalars("amp/scale")] == list(range(1, 10))
    assert read("amp/scale") == scales
    assert read("amp/log2_scale") == pytest.approx([math.log2(s) for s in scales])
    assert read("amp/skipped") == [float(s) for s in skips]
    assert read("amp/skipped_total")[-1] == sum(skips)
    assert all(skips[i] for i in OVERFLOW_AT)
    finite = [n for n in norms if math.isfinite(n)]
    assert [n for n in read("amp/grad_norm") if math.isfinite(n)] == pytest.approx(finite)


def test_windows_sum_skips_and_flush_the_rest(tmp_path: Path) -> None:
    class Collect(WindowedUpdateHook):
        def __init__(self, every_n: int) -> None:
            super().__init__(every_n)
            self.records: list[UpdateRecord] = []

        def emit(self, record: UpdateRecord) -> None:
            self.records.append(record)

    hook = Collect(every_n=4)
    scales, skips, norms = train([hook])
    assert [r.iteration for r in hook.records] == [4, 8]
    assert [r.skipped for r in hook.records] == [sum(skips[:4]), sum(skips[4:8])]
    assert [r.scale for r in hook.records] == [scales[3], scales[7]]
    assert hook.records[-1].grad_norm == pytest.approx(norms[7], nan_ok=True)
    hook.flush()  # the partial last window (iteration 9)
    assert (hook.records[-1].iteration, hook.records[-1].window) == (9, 1)
    assert hook.records[-1].skipped_total == sum(skips)
    hook.flush()  # nothing pending: no record
    assert len(hook.records) == 3


def test_logging_hook_lines_and_levels(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("mixprec.test")
    hook = LoggingHook(logger, every_n=1)
    with caplog.at_level(logging.INFO, logger="mixprec.test"):
        scales, skips, _ = train([hook], steps=4)
    assert len(caplog.records) == 4
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.WARNING if s else logging.INFO for s in skips]
    assert (
        caplog.records[3]
        .getMessage()
        .startswith(
            f"mixprec: iteration 4: scale {scales[3]:g}, {int(skips[3])} of the last 1 steps "
            f"skipped ({sum(skips)} in total), grad norm "
        )
    )


def test_detach_stops_logging_and_every_n_is_validated(caplog: pytest.LogCaptureFixture) -> None:
    hook = LoggingHook(logging.getLogger("mixprec.test"), every_n=1)
    with caplog.at_level(logging.INFO, logger="mixprec.test"):
        train([hook], steps=1)
        hook.detach()
        scaler = mixprec.GradScaler()
        hook.attach(scaler).detach()
    assert len(caplog.records) == 1
    for bad in (0, 1.5, True):
        with pytest.raises(ConfigError, match="every_n must be an int >= 1"):
            LoggingHook(every_n=bad)  # type: ignore[arg-type]
