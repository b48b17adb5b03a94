"""``mixprec advise MODULE:FACTORY``: measure a model's modules and propose a precision policy.

``FACTORY`` is a function of no arguments in ``MODULE`` (an importable module, ``pkg.models``,
or a Python file, ``examples/advise_gpt.py``, whose folder is put first on ``sys.path`` as
``python FILE`` does, so that it can import its siblings) that returns ``(model, batch,
loss_fn)``, where ``loss_fn(model, batch)`` returns the loss. Prints the advisor's table (or JSON
with ``--json``) and can draw the plot (``--plot PATH``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import mixprec
from mixprec._src.advisor.speed.gpus import get_gpu
from mixprec._src.autocast.targets import split_entries
from mixprec.cli._command import Command, CommandError
from mixprec.cli._output import emit, folder_problem, write_file
from mixprec.errors import ConfigError

__all__ = ["COMMAND", "call_factory", "load_factory", "run", "unpack"]

_EXAMPLE = "examples/advise_gpt.py:make_gpt"


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="MODULE:FACTORY", help=f"e.g. {_EXAMPLE}")
    p.add_argument(
        "--candidates",
        default=None,
        help="precision rule words in any order, comma-separated: fp16, bf16, fp8, "
        "fp8:rowwise, mxfp8, nvfp4, ... (tried cheapest first: with --gpu the fastest, else the "
        "fewest bits; default: torch's autocast dtype for the device: bf16 on the CPU, fp16 on "
        "CUDA)",
    )
    p.add_argument(
        "--min-sqnr",
        type=float,
        metavar="DB",
        help="target: the least whole-model gradient SQNR (signal-to-quantization-noise ratio "
        "against float32, in dB; higher is better: one tensor rounded to bf16 is about 47, to "
        "fp8 21-29) (default: none: only --keep-at-most, or the cheapest finite candidates)",
    )
    p.add_argument(
        "--keep-at-most",
        type=int,
        metavar="K",
        help="keep at most K modules out of the candidates; with no --min-sqnr, keep the K "
        "most sensitive (default: no limit)",
    )
    _speed_arguments(p)
    _output_arguments(p)


def _speed_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--gpu",
        type=_gpu,
        metavar="NAME",
        help="predict each module's time on this GPU: h100, h200, h200-nvl, b200, b300 "
        "(default: no prediction)",
    )
    p.add_argument(
        "--objective",
        choices=["fewest_kept", "speed", "sqnr"],
        default="fewest_kept",
        help="once --min-sqnr is met: keep the fewest modules, or the fastest policy on --gpu; "
        "sqnr: the most precise policy at least --min-speedup times faster than bf16 on --gpu",
    )
    p.add_argument(
        "--min-speedup",
        type=float,
        metavar="X",
        help="with --objective sqnr: the least predicted speedup against bf16 (e.g. 1.5)",
    )
    p.add_argument(
        "--whole-modules",
        dest="per_matmul",
        action="store_false",
        help="measure each module whole (one pass per recipe) and give its three matmuls one "
        "choice (default: each recipe measured per matmul, fprop, dgrad and wgrad chosen apart)",
    )


def _output_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--modules",
        help="comma-separated name globs to measure; a comma inside a glob's [...] belongs to "
        "the glob (default: every leaf module with trainable parameters except norms and "
        "embeddings)",
    )
    p.add_argument(
        "--check", dest="measure", action="store_true", help="apply the proposal and measure it"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument(
        "--wide",
        action="store_true",
        help="the full table: every SQNR per candidate, fp16 range and fp8 cast figures, the "
        "reasons in a column (default: lines of at most 100 characters)",
    )
    p.add_argument("--plot", type=Path, metavar="PATH", help="write the plot (.png, .svg, .pdf)")
    p.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's)")


def _gpu(text: str) -> str:
    try:
        get_gpu(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _check(args: argparse.Namespace) -> str | None:
    module, sep, name = args.target.rpartition(":")
    if not sep or not module or not name:
        return f"{args.target!r} is not MODULE:FACTORY; e.g. {_EXAMPLE}"
    if args.keep_at_most is not None and args.keep_at_most < 0:
        return f"--keep-at-most {args.keep_at_most}: use 0 or more"
    if args.threads is not None and args.threads < 1:
        return f"--threads {args.threads}: use 1 or more"
    if args.objective in ("speed", "sqnr") and args.gpu is None:
        return f"--objective {args.objective} needs --gpu (e.g. --gpu h100)"
    if (args.objective == "sqnr") != (args.min_speedup is not None):
        return "--objective sqnr and --min-speedup X go together"
    if args.plot is not None:
        problem = folder_problem(args.plot.parent) or plot_format_problem(args.plot)
        if problem is not None:
            return f"--plot {args.plot}: {problem}"
    return None


def plot_format_problem(path: Path) -> str | None:
    """Why matplotlib could not write ``path`` (its suffix), or None (also when matplotlib is
    missing: the run then notes that no plot was drawn)."""
    suffix = path.suffix.lower().lstrip(".")
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return None if suffix else "give the file a suffix: .png, .svg or .pdf"
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix in formats:
        return None
    return (
        f"matplotlib cannot write {suffix or 'a file without a suffix'!r}; use .png, .svg or .pdf"
    )


def load_factory(target: str) -> Callable[[], Any]:
    """Resolve ``MODULE:FACTORY`` to the factory function.

    Raises:
        ConfigError: the module cannot be found or imported, or has no such callable.
    """
    where, _, name = target.rpartition(":")
    module = _import(where)
    factory = getattr(module, name, None)
    if factory is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ConfigError(
            f"{where} has no {name!r}; its functions and classes: {', '.join(public) or '(none)'}"
        )
    if not callable(factory):
        raise ConfigError(f"{where}:{name} is a {type(factory).__name__}, not a function")
    _check_no_arguments(factory, target)
    return factory


def _check_no_arguments(factory: Callable[..., Any], target: str) -> None:
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: the call tells
        return
    needed = [
        p.name
        for p in signature.parameters.values()
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if needed:
        raise ConfigError(
            f"{target} needs arguments ({', '.join(needed)}); the command line calls the "
            "factory with none: give them defaults, or write a factory of no arguments that "
            "calls it"
        )


def _import(where: str) -> Any:
    if where.endswith(".py") or "/" in where or "\\" in where:
        return _load_file(where)
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # as `python -m` does: modules of the current folder import
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as exc:
        if exc.name and where.startswith(exc.name):
            raise ConfigError(
                f"cannot import {where!r} ({exc}); pass an importable module or a .py file"
            ) from None
        raise _import_failed(where, exc) from exc
    except Exception as exc:  # the module's own code raised while it was imported
        raise _import_failed(where, exc) from exc


def _load_file(where: str) -> Any:
    """Run a Python file as a module, its folder first on ``sys.path`` (as ``python FILE``)."""
    path = Path(where)
    if not path.is_file():
        raise ConfigError(f"file {where} does not exist")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{where} cannot be loaded as a Python module")
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(path.stem, module)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the file's own code raised (an import it needs, a bug)
        raise _import_failed(where, exc) from exc
    return module


def _import_failed(where: str, exc: Exception) -> ConfigError:
    return ConfigError(f"importing {where} failed: {type(exc).__name__}: {exc}")


def unpack(made: object, target: str) -> tuple[nn.Module, Any, Callable[..., Any]]:
    """Check what the factory returned: ``(model, batch, loss_fn)``."""
    form = "(model, batch, loss_fn) with loss_fn(model, batch) -> loss"
    if not isinstance(made, (tuple, list)) or len(made) != 3:
        got = f"a {len(made)}-tuple" if isinstance(made, (tuple, list)) else type(made).__name__
        raise ConfigError(f"{target} returned {got}; it must return {form}")
    model, batch, loss_fn = made
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"{target} returned a {type(model).__name__} as the model; it must return {form}, "
            "the model a torch.nn.Module"
        )
    if not callable(loss_fn):
        raise ConfigError(
            f"{target} returned a {type(loss_fn).__name__} as loss_fn; it must return {form}"
        )
    return model, batch, loss_fn


def run(args: argparse.Namespace) -> int:
    """Build the model with the factory, advise, print the report."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, batch, loss_fn = unpack(
        call_factory(load_factory(args.target), args.target), args.target
    )
    progress = None if args.no_progress else _progress_lines
    advice = mixprec.advise(
        model,
        batch,
        loss_fn,
        candidates=args.candidates,
        min_sqnr=args.min_sqnr,
        keep_at_most=args.keep_at_most,
        modules=_globs(args.modules),
        check=args.measure,
        progress=progress,
        gpu=args.gpu,
        objective=args.objective,
        per_matmul=args.per_matmul,
        min_speedup=args.min_speedup,
    )
    emit(advice.to_json() if args.json else advice.table(wide=args.wide))
    if args.plot is not None:
        try:
            write_file(args.plot, advice.plot)
        except ImportError as exc:
            print(f"mixprec advise: note: no plot: {exc}", file=sys.stderr)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise CommandError(f"the plot could not be written to {args.plot} ({reason})") from None
        else:
            if not args.json:
                emit(f"plot: {args.plot}")
    return 0


def _globs(text: str | None) -> list[str] | None:
    """``--modules``: split at the commas a policy string splits at (not inside ``[...]``)."""
    if not text:
        return None
    return [g.strip() for g in split_entries(text) if g.strip()]


def call_factory(factory: Callable[[], Any], target: str) -> Any:
    """The factory's result; its own errors as one line (a CommandError)."""
    try:
        return factory()
    except (ConfigError, KeyboardInterrupt):
        raise
    except Exception as exc:  # the factory's own code: one line, not a traceback
        raise CommandError(f"{target} raised {type(exc).__name__}: {exc}") from exc


def _progress_lines(done: int, total: int, label: str) -> None:
    print(f"mixprec advise: [{done}/{total}] {label}", file=sys.stderr, flush=True)


COMMAND = Command(
    name="advise",
    summary="measure every module in low precision and propose a policy",
    description=(
        "Measures each module of a model in low precision against a float32 reference and\n"
        "proposes a precision policy. MODULE:FACTORY names a function of no arguments in an\n"
        "importable module or a Python file that returns (model, batch, loss_fn), where\n"
        "loss_fn(model, batch) returns the loss. Prints the advisor's table (or JSON); see\n"
        "docs/advisor.md.\n\n"
        "Error is measured as SQNR, the signal-to-quantization-noise ratio of the gradients\n"
        "against float32, in dB: higher is better (one tensor rounded to bf16: about 47 dB,\n"
        "to fp8: 21-29 dB)."
    ),
    examples=(
        f"mixprec advise {_EXAMPLE} --candidates fp8 --min-sqnr 30 --keep-at-most 2 --check",
        f"mixprec advise {_EXAMPLE} --candidates fp8,fp8:rowwise --min-sqnr 30 --json",
        f"mixprec advise {_EXAMPLE} --candidates fp8 --min-sqnr 30 --gpu h100 --objective speed",
        f"mixprec advise {_EXAMPLE} --candidates nvfp4,mxfp8,bf16 --gpu b200 --objective sqnr "
        "--min-speedup 1.5",
        "mixprec advise mypkg.models:make_model --candidates fp16 --check --plot advice.png",
    ),
    add_arguments=_add_arguments,
    run=run,
    check=_check,
    progress=True,
)
