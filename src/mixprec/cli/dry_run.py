"""``mixprec dry-run MODULE:FACTORY --policy POLICY --gpu GPU``: what a training step under a
policy would run on a GPU, checked on this machine (the meta device, no GPU needed).

``FACTORY`` is as for ``mixprec advise``: a function of no arguments returning ``(model, batch,
loss_fn)``. Prints, per ruled module and matmul, whether the GPU runs it natively, emulates it
(and why) or would refuse the kernel call (the rule broken and the fix), then the bytes each
Linear saves for backward beside bf16 autocast's and torchao's. Exit status 1 when some call
would fail.
"""

from __future__ import annotations

import argparse

import torch

import mixprec
from mixprec._src.advisor.speed.gpus import GPUS, get_gpu
from mixprec.cli._command import Command, CommandError
from mixprec.cli._output import emit
from mixprec.cli.advise import call_factory, load_factory, unpack
from mixprec.errors import ConfigError

__all__ = ["COMMAND", "run"]

_EXAMPLE = "examples/advise_gpt.py:make_gpt"
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _gpus(text: str) -> list[str]:
    words = [w.strip() for w in text.split(",") if w.strip()]
    try:
        return [get_gpu(w).word for w in words]
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="MODULE:FACTORY", help=f"e.g. {_EXAMPLE}")
    p.add_argument("--policy", required=True, help="the precision policy, e.g. 'blocks=mxfp8'")
    p.add_argument(
        "--gpu",
        type=_gpus,
        default="h100,b200",
        help=f"GPUs, comma-separated (known: {', '.join(GPUS)})",
    )
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="the region's dtype")
    p.add_argument("--width", type=int, default=100, help="the table's width in columns")


def run(args: argparse.Namespace) -> int:
    """Build the model with the factory, dry-run it on each GPU, print the tables."""
    model, batch, loss_fn = unpack(
        call_factory(load_factory(args.target), args.target), args.target
    )
    failing = []
    for i, gpu in enumerate(args.gpu):
        result = mixprec.dry_run(model, batch, loss_fn, args.policy, gpu, _DTYPES[args.dtype])
        emit(("\n" if i else "") + result.table(args.width))
        if not result.ok:
            failing.append(gpu)
    if failing:
        raise CommandError(f"some matmuls would fail on {', '.join(failing)} (see the table)")
    return 0


COMMAND = Command(
    name="dry-run",
    summary="check on the CPU what a policy's matmuls would run on a GPU",
    description=(
        "Runs one training step of a meta copy of the model (no data, no GPU) under the\n"
        "policy, routing each low-precision matmul as the GPU would: its hardware kernel where\n"
        "the GPU's compute capability has one (the call checked by torch's meta kernel and by\n"
        "the CUDA rules meta lacks), emulation where not. Prints per module and matmul:\n"
        "native, emulated (why) or would fail (the rule and the fix), and the bytes saved for\n"
        "backward. See docs/dry-run.md."
    ),
    examples=(
        f"mixprec dry-run {_EXAMPLE} --policy 'blocks=fp8:blockwise' --gpu h100,b200",
        f"mixprec dry-run {_EXAMPLE} --policy 'blocks.*.mlp.*=mxfp8/mxfp8/nvfp4' --gpu b200",
    ),
    add_arguments=_add_arguments,
    run=run,
)
