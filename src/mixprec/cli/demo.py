"""``mixprec demo``: the same network trained three ways, to show why loss scaling matters.

1. float32 (the reference);
2. low-precision autocast (float16 by default) without scaling: small gradients flush to zero;
3. the same with :class:`mixprec.GradScaler`: the gradients survive and the run tracks float32.

Prints a table (or JSON with ``--json``) and writes a PNG figure into ``--out``.
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
from mixprec.cli import _report, _task
from mixprec.cli._figure import PlotUnavailable, write_figure
from mixprec.cli._progress import Progress

__all__ = ["add_parser", "run"]

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


def _device(text: str) -> torch.device:
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a device; use cpu, cuda, cuda:1, mps, ..."
        ) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(
            f"{text!r}: CUDA is not available here (torch.cuda.is_available() is False); "
            "use --device cpu"
        )
    try:
        float((torch.ones(2, device=dev) + 1).sum())  # allocates, computes and reads back
    except Exception as exc:  # any backend error means the device cannot be used
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise argparse.ArgumentTypeError(
            f"{text!r} cannot be used ({first}); use --device cpu"
        ) from None
    return dev


def _dtype(text: str) -> torch.dtype:
    if text.lower() not in _DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r} is not supported; use float16 or bfloat16")
    return _DTYPES[text.lower()]


def add_parser(sub: Any) -> None:
    """Register ``demo`` on an ``argparse`` subparsers object."""
    p = sub.add_parser(
        "demo",
        help="train a small network in fp32, fp16 and fp16 + GradScaler, and compare",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--device", type=_device, default=torch.device("cpu"), help="default: cpu")
    p.add_argument(
        "--dtype", type=_dtype, default=torch.float16, help="float16 (default) or bfloat16"
    )
    p.add_argument("--steps", type=_int_in(1, 1_000_000), default=DEFAULT_STEPS)
    p.add_argument(
        "--inject-inf",
        type=_int_in(0, 1_000_000),
        metavar="STEP",
        help="write an inf into a gradient of the scaled run at STEP (0-based): a skip + backoff",
    )
    p.add_argument("--out", type=Path, default=Path(DEFAULT_OUT), help="figure folder")
    p.add_argument("--seed", type=_int_in(0, 2**63 - 1), default=0)
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plot", action="store_true", help="do not draw the figure")
    p.set_defaults(handler=run, check=_check)


def _check(args: argparse.Namespace) -> str | None:
    """Cross-option checks; returns an error message or None."""
    if args.inject_inf is not None and args.inject_inf >= args.steps:
        return f"--inject-inf {args.inject_inf} is not a step of the run; use 0..{args.steps - 1}"
    if args.out.exists() and not args.out.is_dir():
        return f"--out {args.out} exists and is not a folder; pass a folder"
    if not args.no_plot:
        try:
            args.out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return (
                f"--out {args.out} cannot be created ({exc.strerror or exc}); pass another folder"
            )
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
    small, and one thread is as fast and much steadier on a busy machine."""
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
    out = sys.stdout
    if not args.json:
        print(_intro(config), file=out, flush=True)
    task = _task.make_task(args.seed, args.steps, args.device)
    results = []
    with _cpu_threads(args.device) as threads:
        config["cpu_threads"] = threads
        for spec in _specs(args.dtype):
            with Progress(args.steps, spec.name, enabled=not args.no_progress) as bar:
                results.append(_task.train(task, spec, args.dtype, args.inject_inf, bar.update))
    figure, note = None, None
    if not args.no_plot:
        try:
            figure = str(write_figure(results, args.out / FIGURE_NAME))
        except PlotUnavailable as exc:
            note = str(exc)
    if args.json:
        print(_report.as_json(config, results, figure), file=out)
    else:
        print(f"\n{_report.table(results)}\n\n{_report.verdict(results)}", file=out)
        if figure:
            print(f"Figure: {figure}", file=out)
    if note:
        print(f"mixprec demo: note: {note}", file=sys.stderr)
    return 0
