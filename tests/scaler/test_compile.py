"""torch.compile: a whole training iteration compiles with no graph break caused by mixprec.

A graph break is attributed to the file and line where dynamo stopped tracing (its "in user code
at" location, which dynamo logs for every break). torch's own ``GradScaler`` lives in a file
dynamo refuses to trace, so it breaks the graph at ``scaler.scale``; mixprec is traced through.
With a fused optimizer a mixprec iteration has no break of its own; with a non-fused one it has
exactly one, by design: ``step`` reads the overflow flag to decide whether to call
``optimizer.step`` (see docs/reliability.md).

Cold compiles cost seconds each on 2 cores, so the suite compiles few functions: one with
inductor (compared bit for bit with eager), the others with the ``eager`` backend (dynamo's
tracing and graph breaks are the same; only code generation is skipped).
"""

from __future__ import annotations

import inspect
import logging
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

import mixprec

pytestmark = pytest.mark.slow
BACKEND = os.environ.get("MIXPREC_TEST_COMPILE_BACKEND", "aot_eager")

MIXPREC_SRC = Path(mixprec.__file__).resolve().parent
_BREAK_AT = re.compile(r"in user code at (\S+):(\d+)")
_BREAK_LOGGER = "torch._dynamo.symbolic_convert.__graph_breaks"


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.breaks: list[tuple[Path, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        match = _BREAK_AT.search(text)
        if match:
            self.breaks.append((Path(match.group(1)).resolve(), int(match.group(2)), text))


@contextmanager
def graph_breaks() -> Iterator[list[tuple[Path, int, str]]]:
    """Every graph break dynamo reports inside the block: (file, line, log text)."""
    logger = logging.getLogger(_BREAK_LOGGER)
    handler = _Collect()
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        yield handler.breaks
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def in_mixprec(breaks: list[tuple[Path, int, str]]) -> list[tuple[Path, int, str]]:
    return [b for b in breaks if MIXPREC_SRC in b[0].parents]


def _source_line(path: Path, line: int) -> str:
    return path.read_text().splitlines()[line - 1].strip()


def describe(breaks: list[tuple[Path, int, str]]) -> list[str]:
    """``file:line: source  (dynamo's explanation)`` for each break."""
    out = []
    for path, line, text in breaks:
        why = [s.strip() for s in text.splitlines() if "Explanation:" in s or "Reason:" in s]
        out.append(f"{path}:{line}: {_source_line(path, line)}  ({' / '.join(why)[:300]})")
    return out


def make_training(
    scaler: Any, fused: bool, seed: int = 0
) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[torch.Tensor], torch.Tensor]]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    if fused:
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)

    def iteration(x: torch.Tensor) -> torch.Tensor:
        with mixprec.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return model, opt, iteration


def batches(n: int, overflow_at: tuple[int, ...] = ()) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for i in range(n):
        x = torch.randn(4, 8, generator=gen)
        if i in overflow_at:
            x[0, 0] = 1e6  # the fp16 forward overflows: inf/NaN grads, a skipped step
        out.append(x)
    return out


def _run(iteration: Callable[[torch.Tensor], torch.Tensor], scaler: Any, xs: list) -> list:
    trace = []
    for x in xs:
        iteration(x)
        trace.append(scaler.get_scale())  # an eager read between compiled calls, as in logging
    return trace


def test_fused_iteration_compiles_and_matches_eager() -> None:
    torch._dynamo.reset()
    xs = batches(8, overflow_at=(2,))
    eager_scaler = mixprec.GradScaler(init_scale=2.0**10, growth_interval=2)
    eager_model, _, eager_it = make_training(eager_scaler, fused=True)
    eager_it(xs[0])  # the fused optimizer's first step creates its state (one host read)
    eager_trace = _run(eager_it, eager_scaler, xs[1:])

    scaler = mixprec.GradScaler(init_scale=2.0**10, growth_interval=2)
    model, _, iteration = make_training(scaler, fused=True)
    iteration(xs[0])
    compiled = torch.compile(iteration, backend=BACKEND)
    with graph_breaks() as breaks:
        trace = _run(compiled, scaler, xs[1:4])  # warm-up, including the overflow
        graphs = counters["stats"]["unique_graphs"]
        trace += _run(compiled, scaler, xs[4:])  # growth: a new scale, same graphs
    # Nothing guards on a value that changes every iteration (scale, counters): no recompiles.
    assert counters["stats"]["unique_graphs"] == graphs

    assert breaks, "the graph-break log captured nothing: the attribution below would be vacuous"
    ours = describe(in_mixprec(breaks))
    assert ours == [], f"graph breaks inside mixprec: {ours}"
    assert trace == eager_trace
    assert trace[1] == trace[0] / 2  # xs[2] overflowed: backed off, compiled as in eager
    assert scaler.stats() == eager_scaler.stats()
    assert scaler.state_dict() == eager_scaler.state_dict()
    for p, q in zip(model.parameters(), eager_model.parameters(), strict=True):
        if BACKEND == "inductor":  # its generated forward kernels round differently from eager
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
        else:
            assert torch.equal(p, q)


def test_torch_gradscaler_breaks_the_graph_at_scale() -> None:
    """The comparison point: dynamo does not trace into torch.amp.GradScaler.scale."""
    torch._dynamo.reset()
    xs = batches(3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    _, _, iteration = make_training(scaler, fused=True)
    iteration(xs[0])
    compiled = torch.compile(iteration, backend="eager")
    with graph_breaks() as breaks:
        for x in xs[1:]:
            compiled(x)
    at_scale = (Path(__file__).resolve(), _line_of(make_training, "scaler.scale(loss).backward()"))
    reasons = [text for path, line, text in breaks if (path, line) == at_scale]
    assert any("skipped" in text for text in reasons), describe(breaks)


def test_non_fused_step_breaks_once_by_design() -> None:
    """A non-fused ``step`` must decide on the host whether to call ``optimizer.step``."""
    torch._dynamo.reset()
    xs = batches(4, overflow_at=(2,))
    scaler = mixprec.GradScaler(init_scale=2.0**10, growth_interval=2)
    _, _, iteration = make_training(scaler, fused=False)
    compiled = torch.compile(iteration, backend="eager")
    with graph_breaks() as breaks:
        trace = _run(compiled, scaler, xs)
    ours = {_source_line(p, n) for p, n, _ in in_mixprec(breaks)}
    assert len(ours) == 1 and ".item()" in ours.pop()
    eager_scaler = mixprec.GradScaler(init_scale=2.0**10, growth_interval=2)
    _, _, eager_iteration = make_training(eager_scaler, fused=False)
    assert trace == _run(eager_iteration, eager_scaler, xs)
    assert trace[2] == trace[1] / 2  # xs[2] overflowed
    assert scaler.stats() == eager_scaler.stats()
    assert scaler.stats().steps_skipped == 1


def _line_of(function: Callable[..., Any], text: str) -> int:
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


def test_mixprec_autocast_region_compiles() -> None:
    torch._dynamo.reset()
    model = nn.Linear(8, 4)

    def forward(x: torch.Tensor) -> torch.Tensor:
        with mixprec.autocast("cpu", dtype=torch.float16):
            return model(x).float().sum()

    with graph_breaks() as breaks:
        torch.compile(forward, backend="eager")(torch.randn(2, 8))
    assert describe(in_mixprec(breaks)) == []
