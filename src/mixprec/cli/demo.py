"""``mixprec demo``: the same network trained three ways, to show why loss scaling matters.

1. float32 (the reference);
2. low-precision autocast (float16 by default) without scaling: small gradients flush to zero;
3. the same with :class:`mixprec.GradScaler`: the gradients survive and the run tracks float32.

Prints a table (or JSON with ``--json``) and writes a PNG figure into ``--out``: the cause (the
gradients against the low precision's range, without and with the scale), the flushed fraction
over the steps, the loss curves and the scale.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import mixprec
from mixprec._src.torch_compat import public_attr
from mixprec.cli import _report, _task
from mixprec.cli._command import Command, CommandError, progress
from mixprec.cli._figure import PlotUnavailable, write_figure
from mixprec.cli._output import emit, folder_problem, write_file

__all__ = ["COMMAND", "run"]

DEFAULT_STEPS = 300
DEFAULT_OUT = "mixprec-demo"
FIGURE_NAME = "mixprec-demo.png"
_DTYPES = {"float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
_DTYPES |= {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def _int_in(low: int, high: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is out of range; use {low}..{high}")
        return value

    return parse


def _available(dev: torch.device) -> bool | None:
    """``torch.<type>.is_available()`` where torch has one (cuda, mps, xpu, ...), else None."""
    module = public_attr(torch, dev.type, None)
    check = getattr(module, "is_available", None)
    return bool(check()) if callable(check) else None


def _device(text: str) -> torch.device:
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a device; use cpu, cuda, cuda:1, mps, ..."
        ) from None
    if _available(dev) is False:
        raise argparse.ArgumentTypeError(
            f"{text!r}: no {dev.type} device is available here (torch.{dev.type}.is_available() "
            "is False); use --device cpu"
        )
    try:
        float((torch.ones(2, device=dev) + 1).sum())  # allocates, computes and reads back
    except Exception as exc:  # any backend error means the device cannot be used
        first = str(exc).strip().split(". ")[0].splitlines()[0] if str(exc).strip() else ""
        reason = first[:120] + ("..." if len(first) > 120 else "") or type(exc).__name__
        raise argparse.ArgumentTypeError(
            f"{text!r} cannot be used ({reason}); use --device cpu"
        ) from None
    return dev


def _dtype(text: str) -> torch.dtype:
    if text.lower() not in _DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r} is not supported; use float16 or bfloat16")
    return _DTYPES[text.lower()]


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", type=_device, default="cpu", help="where to train")
    p.add_argument(
        "--dtype",
        type=_dtype,
        default="float16",
        help="the low precision: float16 (fp16) or bfloat16 (bf16)",
    )
    p.add_argument(
        "--steps", type=_int_in(1, 1_000_000), default=DEFAULT_STEPS, help="steps per run"
    )
    p.add_argument(
        "--inject-inf",
        type=_int_in(0, 1_000_000),
        metavar="STEP",
        help="write an inf into a gradient of the scaled run at STEP (0..steps-1), as an fp16 "
        "overflow would: one more skipped step and backoff (default: none)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, metavar="DIR", help="figure folder")
    p.add_argument("--seed", type=_int_in(0, 2**63 - 1), default=0, help="random seed")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--no-plot", action="store_true", help="do not draw the figure")


def _check(args: argparse.Namespace) -> str | None:
    """Cross-option checks; returns an error message or None. Creates nothing."""
    if args.inject_inf is not None and args.inject_inf >= args.steps:
        return (
            f"--inject-inf {args.inject_inf} is not a step of the run; use "
            f"0..{args.steps - 1} (--steps {args.steps})"
        )
    if not args.no_plot:
        problem = folder_problem(args.out)
        if problem is not None:
            return f"--out {args.out}: {problem}; pass another folder or --no-plot"
    return None


def _specs(dtype: torch.dtype) -> list[_task.RunSpec]:
    low = "fp16" if dtype == torch.float16 else "bf16"
    return [
        _task.RunSpec("fp32", autocast=False, scaled=False),
        _task.RunSpec(f"{low} (no scaling)", autocast=True, scaled=False),
        _task.RunSpec(f"{low} + GradScaler", autocast=True, scaled=True),
    ]


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "device": str(args.device),
        "dtype": str(args.dtype).removeprefix("torch."),
        "steps": args.steps,
        "seed": args.seed,
        "inject_inf": args.inject_inf,
        "out": str(args.out),
        "task": (
            f"regression {_task.D_IN}->{_task.WIDTH}->{_task.WIDTH}->{_task.D_OUT} MLP (tanh), "
            f"targets {_task.TARGET_SCALE} * sin(1.5 x W), MSE, Adam lr={_task.LR}, "
            f"batch {_task.BATCH}"
        ),
        "growth_interval": _task.GROWTH_INTERVAL,
        "mixprec": mixprec.__version__,
        "torch": torch.__version__,
    }


def _intro(config: dict[str, Any]) -> str:
    return (
        f"mixprec demo: {config['task']}; {config['steps']} steps on {config['device']}, "
        f"seed {config['seed']}.\nThe scaled run uses GradScaler(growth_interval="
        f"{config['growth_interval']}) (torch's default is 2000) so that a short run shows the "
        "scale growing until the gradients overflow."
    )


@contextlib.contextmanager
def _cpu_threads(device: torch.device) -> Iterator[int]:
    """One intra-op thread on the CPU unless OMP_NUM_THREADS says otherwise: the network is
    small, and one thread is as fast and steadier when other processes hold the cores."""
    before = torch.get_num_threads()
    if device.type != "cpu" or "OMP_NUM_THREADS" in os.environ:
        yield before
        return
    torch.set_num_threads(1)
    try:
        yield 1
    finally:
        torch.set_num_threads(before)


def run(args: argparse.Namespace) -> int:
    """Train the three runs, then print the table (or JSON) and write the figure."""
    config = _config(args)
    if not args.json:
        emit(_intro(config))
    task = _task.make_task(args.seed, args.steps, args.device)
    results = []
    with _cpu_threads(args.device) as threads:
        config["cpu_threads"] = threads
        for spec in _specs(args.dtype):
            with progress(args, args.steps, spec.name) as bar:
                results.append(_task.train(task, spec, args.dtype, args.inject_inf, bar.update))
    figure, note, problem = _draw(args, results)
    if args.json:
        emit(_report.as_json(config, results, figure, problem))
    else:
        emit(f"\n{_report.table(results)}\n\n{_report.verdict(results)}")
        if figure:
            emit(f"Figure: {figure}")
    if note:
        print(f"mixprec demo: note: {note}", file=sys.stderr)
    if problem:  # the results are out; the exit status says that the figure is missing
        raise CommandError(problem)
    return 0


def _draw(args: argparse.Namespace, results: list[_task.RunResult]) -> tuple[Any, Any, Any]:
    """Write the figure: (its path, a note, an error), each a string or None."""
    if args.no_plot:
        return None, None, None
    path = args.out / FIGURE_NAME
    try:
        write_file(path, lambda tmp: write_figure(results, tmp))
    except PlotUnavailable as exc:
        return None, str(exc), None
    except OSError as exc:
        reason = exc.strerror or str(exc)
        return None, None, f"the figure could not be written to {path} ({reason})"
    return str(path), None, None


COMMAND = Command(
    name="demo",
    summary="why fp16 training needs loss scaling: one network trained three ways, compared",
    description=(
        "Trains the same small network three times, from the same seed, data and batch order:\n"
        "in float32; with float16 autocast and no loss scaling; and with float16 autocast and\n"
        "mixprec.GradScaler. Prints a table (or JSON) of what each run measured, and draws a\n"
        "figure: the gradients against float16's range without and with the scale, the\n"
        "fraction flushed to zero over the steps, the loss curves and the scale."
    ),
    examples=(
        "mixprec demo",
        "mixprec demo --dtype bfloat16 --steps 100",
        "mixprec demo --inject-inf 150 --out results/",
        "mixprec demo --json --no-plot > demo.json",
    ),
    add_arguments=_add_arguments,
    run=run,
    check=_check,
    progress=True,
)
