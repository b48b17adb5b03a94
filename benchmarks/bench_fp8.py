"""Low-precision recipes on Linear(1024,1024)-GELU-Linear(1024,1024), batch 256: numerics, time.

Numerics: SQNR in dB against the fp32 model of the output, the input gradient and both weight
gradients, for each recipe run by mixprec (``Policy("nn.Linear=<rule word>")`` inside a bf16
region: ``fp8``, ``fp8:rowwise``, ``fp8:rowwise_gw_hp``, ``fp8:blockwise``, ``mxfp8``,
``nvfp4``) and by torchao where it has the recipe: torchao.float8's emulated ``Float8Linear`` on
the same bf16 input (the same arithmetic), and torchao's emulated MXFP8 training
(``MXFP8_EMULATED_RCEIL``), run in fp32 (it refuses a bf16 input beside fp32 weights) with each
Linear's bias added outside it (its MXFP8 Linear drops the bias: docs/fp8.md); plus bf16
autocast for scale; then again with 8 outlier input rows (x100).

Time: forward+backward per configuration, printed relative to fp32, to bf16 autocast and to
torchao's emulated path on the same recipe. Eager: side by side in one process (shuffled rounds,
medians). ``torch.compile``d (inductor): each configuration in a process of its own (one
configuration's compiled code, Dynamo caches and allocations cannot slow another's), ``--repeats``
processes per configuration in shuffled order, the median of their medians; then mixprec's compiled
time over torchao's, per recipe: the median of the ratios of mixprec's and torchao's processes run
back to back (the load of a shared machine drifts over minutes; pairs cancel it). On a CUDA device
with the kernels mixprec takes the hardware path; on the CPU low precision is a numerics simulator
and its speed is that of emulation.

Run: ``python benchmarks/bench_fp8.py [--rounds 7] [--repeats 3] [--device cpu|cuda]
[--no-compile] [--recipes tensorwise,rowwise,rowwise_gw_hp,blockwise,mxfp8,nvfp4] [--batch 256]
[--width 1024] [--threads N]``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

import mixprec
from mixprec._src.fp8.recipes import rule_word

RECIPES = ("tensorwise", "rowwise", "rowwise_gw_hp", "blockwise", "mxfp8", "nvfp4")
TORCHAO_NAME = {  # torchao.float8's recipe names; "mxfp8" is its prototype MXFP8 training
    "tensorwise": "tensorwise",
    "rowwise": "rowwise",
    "rowwise_gw_hp": "rowwise_with_gw_hp",
    "mxfp8": "mxfp8",
}


def mlp(width: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))


def sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.detach().double(), got.detach().double()
    return float(20 * torch.log10(ref.norm() / (ref - got).norm()))


Step = Callable[[torch.Tensor, torch.Tensor], list[torch.Tensor]]


def make_step(
    model: nn.Module,
    region: Callable[[], AbstractContextManager[Any]],
    cast_input: torch.dtype | None = None,
) -> Step:
    """One forward+backward; returns output, input grad and the two weight grads."""

    def step(x: torch.Tensor, target: torch.Tensor) -> list[torch.Tensor]:
        for p in model.parameters():
            p.grad = None
        x = x.detach().requires_grad_()
        inp = x if cast_input is None else x.to(cast_input)
        with region():
            out = model(inp)
        loss = (out.float() - target).square().mean()
        loss.backward()
        weights = [m.weight.grad for m in model.modules() if isinstance(m, nn.Linear)]
        return [out, x.grad, *weights]  # type: ignore[list-item]

    return step


class _Bias(nn.Module):
    """A Linear's bias added after it (torchao 0.18's MXFP8 Linear drops its own)."""

    def __init__(self, bias: nn.Parameter) -> None:
        super().__init__()
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bias


def torchao_model(model: nn.Module, recipe: str) -> nn.Module:
    if recipe == "mxfp8":
        return _torchao_mxfp8(model)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(TORCHAO_NAME[recipe])
    config = dataclasses.replace(config, emulate=True)
    return convert_to_float8_training(copy.deepcopy(model), config=config)


def _torchao_mxfp8(model: nn.Module) -> nn.Module:
    from torchao.prototype.moe_training.config import (
        MXFP8TrainingOpConfig,
        MXFP8TrainingRecipe,
    )
    from torchao.quantization import quantize_

    layers: list[nn.Module] = []
    for mod in copy.deepcopy(model):
        if isinstance(mod, nn.Linear) and mod.bias is not None:
            bare = nn.Linear(mod.in_features, mod.out_features, bias=False)
            bare.weight = mod.weight
            layers += [bare, _Bias(mod.bias)]
        else:
            layers.append(mod)
    out = nn.Sequential(*layers)
    config = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL)
    quantize_(out, config, filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear))
    return out


def _torchao_input(recipe: str) -> torch.dtype | None:
    """torchao.float8 runs on the bf16 input; its MXFP8 refuses bf16 beside fp32 weights."""
    return None if recipe == "mxfp8" else torch.bfloat16


def configurations(model: nn.Module, device: str, recipes: list[str]) -> dict[str, Step]:
    bf16 = torch.bfloat16
    confs: dict[str, Step] = {
        "fp32": make_step(model, nullcontext),
        "bf16 autocast": make_step(model, lambda: torch.autocast(device, dtype=bf16)),
    }
    for r in recipes:
        policy = mixprec.Policy(f"nn.Linear={rule_word(r)}")
        confs[f"mixprec {r}"] = make_step(  # its own copy: no rule bindings shared
            copy.deepcopy(model), lambda p=policy: mixprec.autocast(device, bf16, policy=p)
        )
        if r in TORCHAO_NAME:
            ao = torchao_model(model, r)
            confs[f"torchao {r}"] = make_step(ao, nullcontext, cast_input=_torchao_input(r))
    return confs


def numerics(
    model: nn.Module, x: torch.Tensor, target: torch.Tensor, device: str, recipes: list[str]
) -> list[str]:
    confs = configurations(model, device, recipes)
    ref = confs.pop("fp32")(x, target)
    rows = []
    for name, step in confs.items():
        got = step(x, target)
        cells = " | ".join(f"{sqnr(a, b):6.2f}" for a, b in zip(ref, got, strict=True))
        rows.append(f"| {name:<22} | {cells} |")
    return rows


def timing(
    confs: dict[str, Step],
    x: torch.Tensor,
    target: torch.Tensor,
    rounds: int,
    sync: Callable[[], None],
) -> dict[str, float]:
    for step in confs.values():  # warm-up (and compilation)
        step(x, target)
        step(x, target)
    times: dict[str, list[float]] = {k: [] for k in confs}
    names = list(confs)
    for _ in range(rounds):
        random.shuffle(names)
        for name in names:
            sync()
            t0 = time.perf_counter()
            confs[name](x, target)
            sync()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def time_table(
    med: dict[str, float], label: str, paired: dict[str, float] | None = None
) -> list[str]:
    """The rows of one mode; ``paired``: mixprec over torchao per recipe, measured in pairs."""
    rows = []
    for name, t in med.items():
        rel_ao = ""
        theirs = med.get("torchao " + name.split()[-1])
        if name.startswith("mixprec ") and theirs is not None:
            ratio = t / theirs if paired is None else paired[name.split()[-1]]
            rel_ao = f"{ratio:.2f}"
        rows.append(
            f"| {label:<8} | {name:<22} | {t * 1e3:9.1f} | {t / med['fp32']:6.2f} | "
            f"{t / med['bf16 autocast']:6.2f} | {rel_ao:>10} |"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (torch's)")
    ap.add_argument("--repeats", type=int, default=3, help="processes per compiled configuration")
    ap.add_argument("--only-compiled", default=None, help=argparse.SUPPRESS)  # (one child process)
    args = ap.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    recipes = [r for r in args.recipes.split(",") if r]
    device = args.device
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    torch.manual_seed(0)
    model = mlp(args.width).to(device)
    x = torch.randn(args.batch, args.width, device=device)
    target = torch.randn(args.batch, args.width, device=device)
    if args.only_compiled is not None:
        return _child(args.only_compiled, model, x, target, device, args.rounds, sync)
    print(
        f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, "
        f"MLP {args.width}-GELU-{args.width}, batch {args.batch}"
    )
    print("\nSQNR vs fp32 (dB)\n| configuration          | output | grad_in | grad_W1 | grad_W2 |")
    print("|---|---:|---:|---:|---:|")
    print("\n".join(numerics(model, x, target, device, recipes)))
    outliers = x.clone()
    outliers[:8] *= 100
    print("\nwith 8 outlier input rows (x100)")
    print("\n".join(numerics(model, outliers, target, device, recipes)))
    print(NO_TORCHAO)

    print("\nforward+backward, median ms; ratios to fp32, bf16 autocast, torchao (same recipe)")
    print("| mode     | configuration          |        ms |  /fp32 |  /bf16 | /torchao |")
    print("|---|---|---:|---:|---:|---:|")
    confs = configurations(model, device, recipes)
    eager = timing(confs, x, target, args.rounds, sync)
    print("\n".join(time_table(eager, "eager")), flush=True)
    ours = [r for r in recipes if r in TORCHAO_NAME]
    modes = {"eager": {r: eager[f"mixprec {r}"] / eager[f"torchao {r}"] for r in ours}}
    if not args.no_compile:
        names = list(confs)
        med, paired = _in_processes(names, argv if argv is not None else sys.argv[1:], args)
        print("\n".join(time_table(med, "compiled", paired)))
        modes["compiled"] = paired
    print(
        "\nmixprec's time over torchao's on the same recipe (goal: at most 1; compiled: the "
        f"median over {args.repeats} pairs of processes run back to back)"
    )
    for mode, by_recipe in modes.items():
        for r, ratio in by_recipe.items():
            print(f"- {mode} {r}: {ratio:.2f}x ({'met' if ratio <= 1 else 'NOT met'})")
    return 0


def _in_processes(
    names: list[str], argv: list[str], args: argparse.Namespace
) -> tuple[dict[str, float], dict[str, float]]:
    """Each compiled configuration timed in a fresh process, ``args.repeats`` times: the median
    over processes of each process's median; and per recipe with a torchao row, the median over
    repeats of mixprec's time over torchao's, the two processes run back to back (in shuffled
    order), so that the load of a shared machine, which drifts over minutes, cancels."""
    runs: dict[str, list[float]] = {name: [] for name in names}
    recipes = [n.split()[1] for n in names if n.startswith("mixprec ")]
    recipes = [r for r in recipes if f"torchao {r}" in names]
    groups = [[f"mixprec {r}", f"torchao {r}"] for r in recipes]
    groups += [[n] for n in names if not any(n in g for g in groups)]
    for _ in range(args.repeats):
        random.shuffle(groups)
        for group in groups:
            for name in random.sample(group, len(group)):
                runs[name].append(_child_time(name, argv))
    paired = {}
    for r in recipes:
        pairs = zip(runs[f"mixprec {r}"], runs[f"torchao {r}"], strict=True)
        paired[r] = statistics.median(m / t for m, t in pairs)
    return {name: statistics.median(runs[name]) for name in names}, paired


def _child_time(name: str, argv: list[str]) -> float:
    cmd = [sys.executable, __file__, *argv, "--only-compiled", name]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} (compiled) failed:\n{done.stderr[-3000:]}")
    return float(done.stdout.split()[-1])


def _child(
    name: str,
    model: nn.Module,
    x: torch.Tensor,
    target: torch.Tensor,
    device: str,
    rounds: int,
    sync: Callable[[], None],
) -> int:
    """One compiled configuration's median time in seconds, alone in this process (printed)."""
    med = timing({name: _compiled(name, model, device)}, x, target, rounds, sync)
    print(med[name])
    return 0


NO_TORCHAO = (
    "\ntorchao rows: torchao.float8's emulated Float8Linear on the same bf16 input; torchao's "
    "emulated MXFP8\ntraining in fp32 (it refuses a bf16 input beside fp32 weights), each "
    "Linear's bias added outside it.\nNo torchao row for blockwise and nvfp4: torchao 0.18 "
    "trains them with Triton kernels only (no CPU\npath); its NVFP4Tensor casts are compared "
    "bit for bit in tests/fp8/test_fp8_blocks.py."
)


def _compiled(name: str, model: nn.Module, device: str) -> Step:
    """The same configuration with its model compiled (the region stays around the call)."""
    bf16 = torch.bfloat16
    inner = torchao_model(model, name.split()[1]) if name.startswith("torchao ") else model
    inner = copy.deepcopy(inner)
    inner.compile()  # in place: the region's module hooks see the model itself
    if name.startswith("torchao "):
        return make_step(inner, nullcontext, cast_input=_torchao_input(name.split()[1]))
    if name == "fp32":
        return make_step(inner, nullcontext)
    if name == "bf16 autocast":
        return make_step(inner, lambda: torch.autocast(device, dtype=bf16))
    policy = mixprec.Policy(f"nn.Linear={rule_word(name.split()[1])}")
    return make_step(inner, lambda: mixprec.autocast(device, bf16, policy=policy))


if __name__ == "__main__":
    raise SystemExit(main())
