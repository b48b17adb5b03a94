"""The checks that need a real CUDA GPU, in one script that runs in a few minutes.

1. Differential core on CUDA, through the path a CUDA user takes (the device-side rule; the host
   only follows the scale when it learns an iteration's outcome): the same fp16-autocast
   training runs with ``torch.amp.GradScaler`` and ``mixprec.GradScaler`` (SGD, Adam, AdamW;
   plain, foreach, fused; inf and NaN injected; with torch's ``unscale_`` + ``clip_grad_norm_``,
   with ``scaler.clip_grad_norm_`` and with ``scaler.clip_grad_norm_(..., in_step=True)``): the
   scale trajectory and the parameters must be bit-identical (mixprec's clips: to float32
   rounding, bit-identical expected with the default power-of-two scales).
2. Clipping inside the step: 100 fused AdamW steps folded against unfolded (fp32 forward:
   parameters within 1e-6; fp32 and fp16 autocast: identical skip decisions).
3. The benchmark table of ``benchmarks/run.py`` on the GPU (with the clip-in-step row).
4. Host syncs per iteration (``torch.cuda.set_sync_debug_mode("warn")``, counting warnings) for
   plain and fused optimizers, mixprec against torch.amp; a fused optimizer must need none
   after its first step, with or without clipping.
5. fp8 (#14, #24, #31): for each recipe (tensorwise, rowwise, rowwise_gw_hp, 128-blocks, MXFP8,
   NVFP4, and three rules per matmul: mxfp8/mxfp8/nvfp4, bf16/tensorwise/tensorwise,
   rowwise/rowwise/bf16), whether the device takes the hardware path (``torch._scaled_mm``,
   with block scales for the block recipes: 128-blocks on compute capability 9.x, MXFP8 and
   NVFP4 from 10.0), the
   path ``Fp8Stats`` reports, and the Linear's output and gradients against the emulated path
   (SQNR; fast accumulation and the kernels' summation order make them differ slightly), with
   the ``_scaled_mm`` calls counted. The speed table is
   ``python benchmarks/bench_fp8.py --device cuda``.

6. The dry run's cases for real (#37): for each rule and shape (features that do and do not need
   the 128x128 scale padding, a 60-token batch), ``mixprec.dry_run``'s answer per matmul for
   this GPU (N native, E emulated, H high precision, F would fail) beside what the GPU did with
   the same calls (each kernel call recorded as it ran; F where it raised), and the real outputs
   and gradients against the emulated path (SQNR, dB).

Run: ``python benchmarks/gpu_check.py [--out report.md] [--repeat 10]``. Without CUDA it says so
and exits with status 0. ``--device cpu`` runs parts 1 and 2 on the CPU (a dry run of the
script's own logic, used by the test suite). Exit status 1 when a check fails (a differential,
the folded clip, or a host sync on a fused path). Standalone: it imports only torch, mixprec and
``benchmarks/run.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import math
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import mixprec


def _load_run_py() -> Any:
    """benchmarks/run.py, next to this file, loaded by path (no sys.path change)."""
    spec = importlib.util.spec_from_file_location(
        "mixprec_bench_run", Path(__file__).with_name("run.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench = _load_run_py()
MakeOpt = Callable[[Any], torch.optim.Optimizer]
OPTIMIZERS: dict[str, MakeOpt] = {
    "sgd": functools.partial(torch.optim.SGD, lr=0.1),
    "sgd-momentum-foreach": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, foreach=True),
    "sgd-momentum-fused": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, fused=True),
    "adam": functools.partial(torch.optim.Adam, lr=1e-2, foreach=False),
    "adam-foreach": functools.partial(torch.optim.Adam, lr=1e-2, foreach=True),
    "adam-fused": functools.partial(torch.optim.Adam, lr=1e-2, fused=True),
    "adamw-fused": functools.partial(torch.optim.AdamW, lr=1e-2, fused=True),
    "sgd-fused": functools.partial(torch.optim.SGD, lr=0.1, fused=True),  # its state stays empty
}
INJECT = {2: math.inf, 5: math.nan}  # iteration -> value written into one grad
CLIP = 0.5


def _clip(scaler: Any, opt: torch.optim.Optimizer, model: torch.nn.Module, clip: str) -> None:
    """The clipping variant of a run (see :func:`train`): torch's, mixprec's, or "none"."""
    if clip == "torch":
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    elif clip in ("fused", "in_step"):
        scaler.clip_grad_norm_(opt, CLIP, in_step=clip == "in_step")


def train(device: torch.device, make_opt: MakeOpt, scaler: Any, clip: str, iters: int = 8):
    """A tiny fp16-autocast MLP run. ``clip``: "none", "torch" (unscale_ + torch's
    clip_grad_norm_), "fused" (scaler.clip_grad_norm_) or "in_step" (the same, folded into the
    step). Returns (scales, params)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model = model.to(device)
    opt = make_opt(model.parameters())
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)) for _ in range(iters)
    ]
    scales = []
    for it, (x, y) in enumerate(batches):
        with torch.autocast(device.type, dtype=torch.float16):
            out = model(x.to(device))
        loss = torch.nn.functional.mse_loss(out.float(), y.to(device))
        scaler.scale(loss).backward()
        if it in INJECT:
            with torch.no_grad():
                model[2].weight.grad[0, 0] = INJECT[it]
        _clip(scaler, opt, model, clip)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales, [p.detach().cpu() for p in model.parameters()]


CLIPS = ("none", "torch", "fused", "in_step")


def differential(device: torch.device) -> tuple[list[str], bool]:
    """Part 1: one table row per (optimizer, clipping) case; True when all pass."""
    rows = ["| optimizer | clipping | scales equal | params | result |", "|---|---|---|---|---|"]
    all_ok = True
    for name, make_opt in OPTIMIZERS.items():
        for clip in CLIPS:
            ref_clip = "none" if clip == "none" else "torch"
            kwargs = {"init_scale": 2.0**16, "growth_interval": 2}
            ref = train(device, make_opt, torch.amp.GradScaler(device.type, **kwargs), ref_clip)
            got = train(device, make_opt, mixprec.GradScaler(device.type, **kwargs), clip)
            same_scales = ref[0] == got[0]
            diff = max(float((a - b).abs().max()) for a, b in zip(ref[1], got[1], strict=True))
            exact = all(torch.equal(a, b) for a, b in zip(ref[1], got[1], strict=True))
            ok = same_scales and (exact if clip in ("none", "torch") else diff <= 1e-5)
            all_ok &= ok
            params = "bit-identical" if exact else f"max abs diff {diff:.2e}"
            rows.append(
                f"| {name} | {clip} | {same_scales} | {params} | {'ok' if ok else 'FAIL'} |"
            )
    return rows, all_ok


def count_syncs(make_opt: MakeOpt, scaler_cls: Any, clip: str, iters: int = 6) -> float:
    """Part 4: host syncs per iteration after two warm-up iterations (CUDA only)."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    model = model.to(device)
    opt = make_opt(model.parameters())
    scaler = scaler_cls("cuda")
    x, y = torch.randn(32, 64, device=device), torch.randn(32, 8, device=device)

    def iteration() -> None:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        _clip(scaler, opt, model, clip)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    for _ in range(2):
        iteration()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(iters):
                iteration()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    return len(syncs) / iters


def sync_table() -> tuple[list[str], bool]:
    """Part 4: syncs per iteration; True when every fused mixprec path has none."""
    rows = [
        "| optimizer | clipping | torch.amp syncs/iter | mixprec syncs/iter | result |",
        "|---|---|---:|---:|---|",
    ]
    all_ok = True
    for name in ("sgd", "adam-foreach", "sgd-fused", "adam-fused", "adamw-fused"):
        for clip in CLIPS:
            theirs = count_syncs(
                OPTIMIZERS[name], torch.amp.GradScaler, "none" if clip == "none" else "torch"
            )
            ours = count_syncs(OPTIMIZERS[name], mixprec.GradScaler, clip)
            ok = "fused" not in name or clip == "torch" or ours == 0
            all_ok &= ok
            rows.append(f"| {name} | {clip} | {theirs:g} | {ours:g} | {'ok' if ok else 'FAIL'} |")
    return rows, all_ok


def host_path_check(device: torch.device) -> tuple[str, bool]:
    """The scaler takes the device path here (the host does not own the scale)."""
    from mixprec._src.devices import caps

    scaler = mixprec.GradScaler(device.type)
    model = torch.nn.Linear(4, 1).to(device)
    opt = torch.optim.Adam(model.parameters(), fused=True)
    for _ in range(2):
        scaler.scale(model(torch.ones(2, 4, device=device)).sum()).backward()
        scaler.step(opt)
        scaler.update()
    pending = scaler._state.read_pending
    on_device = not caps(device).host_memory
    ok = pending == on_device
    text = (
        f"Scaler path on {device}: {'device rule' if on_device else 'host rule'}; after fused "
        f"steps the host {'derives the values when read' if pending else 'holds the values'}: "
        f"{'ok' if ok else 'FAIL'}."
    )
    return text, ok


def fp8_check(
    device: torch.device, m: int = 256, k: int = 1024, n: int = 1024
) -> tuple[list[str], bool]:
    """fp8 (#14, #24): the hardware path against emulation, per recipe, on ``device``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from mixprec._src.fp8.matmul import Plan, fp8_linear, use_scaled_mm
    from mixprec._src.fp8.recipes import RECIPES, get_recipe

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kw: Any = None) -> Any:
            Count.calls += func.overloadpacket.__name__.startswith("_scaled_mm")
            return func(*args, **(kw or {}))

    rows = [
        "| recipe | hardware | path (Fp8Stats) | _scaled_mm calls | output dB | grad input dB "
        "| grad weight dB |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    ok = True
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(device)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(device)
    g = torch.randn(m, n, generator=gen).to(device)
    mixes = ("mxfp8/mxfp8/nvfp4", "bf16/tensorwise/tensorwise", "rowwise/rowwise/bf16")
    for name, recipe in [*RECIPES.items(), *((n, get_recipe(n)) for n in mixes)]:
        fast = use_scaled_mm(device, recipe)
        results = []
        for scaled in (fast, False):
            xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
            Count.calls = 0
            torch.manual_seed(0)  # the same stochastic rounding draws on both paths
            stats = mixprec.Fp8Stats()
            slot = stats.slot(name, device, name)
            with Count():
                out = fp8_linear(xi, wi, None, Plan(recipe, torch.bfloat16, scaled, slot))
                out.backward(g.to(out.dtype))
            results.append(([out, xi.grad, wi.grad], Count.calls, stats.read()[name].path))
        (got, calls, path), (ref, _, _) = results
        db = [
            float(20 * torch.log10(r.detach().double().norm() / (r - a).detach().double().norm()))
            for a, r in zip(got, ref, strict=True)
        ]
        want_calls = sum(a is not None for a, _ in recipe.pairs) if fast else 0
        want_path = "hardware" if fast else "emulated"
        good = calls == want_calls and path == want_path and all(d > 30 for d in db)
        ok &= good
        rows.append(
            f"| {name} | {fast} | {path} | {calls} | "
            + " | ".join(f"{d:.1f}" for d in db)
            + " |"
            + ("" if good else " FAILED")
        )
    return rows, ok


DRY_RULES = (
    "fp8",
    "fp8:rowwise",
    "fp8:rowwise_gw_hp",
    "fp8:blockwise",
    "mxfp8",
    "nvfp4",
    "mxfp8/mxfp8/nvfp4",
    "bf16/fp8/fp8",
)
DRY_SHAPES = ((256, 512, 384), (128, 256, 1024), (256, 1024, 256), (60, 256, 256))
_LETTER = {"native": "N", "emulated": "E", "high precision": "H", "would fail": "F"}


def _gpu_word(cap: tuple[int, int]) -> str:
    """The dry run's GPU with this compute capability (the nearest below it otherwise)."""
    from mixprec._src.advisor.speed.gpus import GPUS

    below = [g for g in GPUS.values() if g.capability <= cap] or list(GPUS.values())
    return max(below, key=lambda g: g.capability).word


def _letters(verdicts: dict[tuple[str, str], str]) -> str:
    per = {mm: _LETTER[v] for (_, mm), v in verdicts.items()}
    return "/".join(per.get(mm, "-") for mm in ("fprop", "dgrad", "wgrad"))


def _case(mkn: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A case's input and weight, the same for the real and the emulated run."""
    m, k, n = mkn
    gen = torch.Generator().manual_seed(0)
    return torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) / k**0.5


def _real_run(device: torch.device, rule: str, mkn: tuple[int, int, int], cap: Any) -> Any:
    """One step on ``device`` with each kernel call recorded as it runs: (verdicts, grads)."""
    from mixprec._src.dryrun.run import _rows
    from mixprec._src.fp8.kernels import DryRunGpu, routed_as

    def launch(found: Any, call: Any) -> torch.Tensor:
        try:
            out = call.run()
        except RuntimeError as exc:
            found.calls.append((found.site, "kernel", (call, [str(exc).splitlines()[0]])))
            raise
        found.calls.append((found.site, "kernel", (call, [])))
        return out

    x0, w0 = _case(mkn)
    model = torch.nn.Sequential(torch.nn.Linear(mkn[1], mkn[2], bias=False)).to(device)
    with torch.no_grad():
        model[0].weight.copy_(w0)
    x = x0.to(device).requires_grad_()
    found = DryRunGpu(cap or (0, 0), launch=launch)
    torch.manual_seed(0)
    try:
        with routed_as(found):
            with mixprec.autocast(device.type, torch.bfloat16, policy=f"0={rule}"):
                out = model(x)
            out.float().square().mean().backward()
    except mixprec.errors.ConfigError:  # refused before any matmul ran (a mix of paths)
        return {}, None
    except RuntimeError:  # a kernel refused its call: recorded by launch
        pass
    verdicts: dict[tuple[str, str], str] = {}
    for row in _rows(found, "this GPU"):
        verdicts[(row.module, row.matmul)] = row.verdict
    grads = None if x.grad is None else [out.detach(), x.grad, model[0].weight.grad]
    return verdicts, grads


def _emulated(device: torch.device, rule: str, mkn: tuple[int, int, int]) -> list[torch.Tensor]:
    """The same step on ``device`` with every matmul emulated (the same random draws)."""
    from mixprec._src.fp8.matmul import Plan, fp8_linear
    from mixprec._src.fp8.recipes import get_recipe

    x0, w0 = _case(mkn)
    x, w = x0.to(device).requires_grad_(), w0.to(device).requires_grad_()
    torch.manual_seed(0)
    plan = Plan(get_recipe(mixprec.Rule(rule).recipe or ""), torch.bfloat16, False)
    out = fp8_linear(x, w, None, plan)
    out.float().square().mean().backward()
    assert x.grad is not None and w.grad is not None
    return [out.detach(), x.grad, w.grad]


def dry_run_check(device: torch.device) -> tuple[list[str], bool]:
    """#37: the dry run's answer for this GPU against what the GPU does with the same calls."""
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    word = _gpu_word(cap or (9, 0))
    rows = [
        f"dry run as {word}; this device: {device} (compute capability {cap})",
        "",
        "| rule | M x K x N | dry run | ran | output dB | grad input dB | grad weight dB |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    ok = True
    for rule in DRY_RULES:
        for mkn in DRY_SHAPES:
            rows_, good = _dry_case(device, rule, mkn, word, cap)
            rows.append(rows_)
            ok &= good
    return rows, ok


def _dry_case(
    device: torch.device, rule: str, mkn: tuple[int, int, int], word: str, cap: Any
) -> tuple[str, bool]:
    m, k, n = mkn
    model = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False))
    x = torch.empty(m, k, requires_grad=True)
    try:
        run = mixprec.dry_run(
            model, x, lambda mo, b: mo(b).float().square().mean(), f"0={rule}", word
        )
    except mixprec.errors.ConfigError as exc:  # the recipe's blocks do not tile the features
        return f"| {rule} | {m}x{k}x{n} | skipped: {str(exc)[:40]} | | | | |", True
    said = "refused" if run.error else _letters(run.verdicts())
    ran, grads = _real_run(device, rule, mkn, cap)
    did = _letters(ran) if ran else "refused"
    db = ["-"] * 3
    good = said == did
    if grads is not None:
        ref = _emulated(device, rule, mkn)
        vals = [
            float(20 * torch.log10(r.double().norm() / (r.double() - a.double()).norm()))
            for a, r in zip(grads, ref, strict=True)
        ]
        db = [f"{v:.1f}" for v in vals]
        good &= all(v > 30 for v in vals)
    return (
        f"| {rule} | {m}x{k}x{n} | {said} | {did} | "
        + " | ".join(db)
        + " |"
        + ("" if good else " DIFFERS")
    ), good


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu: parts 1-2 only")
    parser.add_argument("--repeat", type=int, default=10, help="benchmark rounds per row")
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "CUDA is not available on this machine: nothing to check. Run this script on a "
            "machine with a CUDA GPU (python benchmarks/gpu_check.py)."
        )
        return 0
    start = time.perf_counter()
    lines = [f"# mixprec GPU check ({device})", ""]
    sizes = dataclasses.replace(bench.FULL, repeat=args.repeat)
    lines.append(bench.header(device, sizes) + "\n")
    path, path_ok = host_path_check(device)
    rows, ok = differential(device)
    lines += ["## 1. Differential core against torch.amp", "", path, "", *rows, ""]
    folded, diff, same_skips = bench.folded_accuracy(device)
    folded16, _, same16 = bench.folded_accuracy(device, fp16=True)
    folded_ok = same_skips and same16 and diff <= 1e-6
    lines += ["## 2. Clipping inside the step", "", folded, "", folded16, ""]
    print("\n".join(lines), flush=True)
    more: list[str] = []
    syncs_ok = True
    if device.type == "cuda":
        section = ["## 3. Benchmarks", "", bench.table(bench.run_suite(sizes, device)), ""]
        print("\n".join(section), flush=True)
        more += section
        sync_rows, syncs_ok = sync_table()
        section = ["## 4. Host syncs per iteration", "", *sync_rows, ""]
        print("\n".join(section), flush=True)
        more += section
        fp8_rows, fp8_ok = fp8_check(device)  # fp8 (#14)
        ok &= fp8_ok
        section = ["## 5. Low-precision matmuls: hardware against emulation", "", *fp8_rows, ""]
        print("\n".join(section), flush=True)
        more += section
        dry_rows, dry_ok = dry_run_check(device)  # the dry run's cases for real (#37)
        ok &= dry_ok
        section = ["## 6. The dry run against the GPU", "", *dry_rows, ""]
        print("\n".join(section), flush=True)
        more += section
    all_ok = ok and path_ok and folded_ok and syncs_ok
    footer = (
        f"Done in {time.perf_counter() - start:.0f} s: differential {'ok' if ok else 'FAILED'}, "
        f"path {'ok' if path_ok else 'FAILED'}, clip in step {'ok' if folded_ok else 'FAILED'}, "
        f"host syncs {'ok' if syncs_ok else 'FAILED'}."
    )
    print(footer)
    if args.out is not None:
        args.out.write_text("\n".join([*lines, *more, footer]) + "\n")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
