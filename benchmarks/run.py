"""mixprec's benchmark suite: every scaler benchmark side by side with torch, in one process.

Each row runs three variants round-robin (the order rotates every round, so load drift hits all of
them alike) after a warm-up, and reports medians:

* ``mixprec``: the mixprec call;
* ``torch``: torch's equivalent (``torch.amp.GradScaler``, ``torch.nn.utils.clip_grad_norm_``);
* ``floor``: the bandwidth floor, one plain ``torch._foreach_mul_`` pass over the same grads
  (plus the optimizer step for the training row).

Rows: unscale + check on (a) few big tensors, (b) many small tensors, (c) the same small tensors
laid out flat (:func:`mixprec.flatten_grads`); unscale + norm clipping against torch's
``unscale_`` + ``clip_grad_norm_``; clipping inside a fused AdamW step
(``clip_grad_norm_(..., in_step=True)``: the coefficient folded into ``grad_scale``) against
torch's ``unscale_`` + ``clip_grad_norm_`` + fused AdamW step, whose floor is the fused step
alone; and a small training iteration's scaler work (``step`` + ``update``) against torch.amp.
Unscale rows use a scale of 1 so that repeating them keeps the values (no drift into denormals);
the kernels run the same either way. After the table, the folded clip's accuracy: 100 steps of
a small fp16 model with overflows, folded against unfolded (parameters, skip decisions).

Run: ``python benchmarks/run.py [--quick] [--threads 2] [--repeat 15] [--device cpu|cuda]``.
``--quick`` uses tiny sizes (a smoke test for CI: it checks nothing about speed). The full run
needs about 1 GB of memory (100M fp32 grads are 400 MB). Other ``benchmarks/bench_*.py`` scripts
run afterwards (full mode only).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import mixprec

Step = Callable[[], object]
Variant = tuple[Step | None, Step, Step | None]  # (untimed before, timed, untimed after)


@dataclass(frozen=True)
class Sizes:
    big: tuple[int, int]  # (tensors, elements each)
    small: tuple[int, int]
    mlp: tuple[int, int, int]  # (width, depth, batch)
    fused: tuple[int, int]  # (tensors, elements each) of the clip-in-step row
    repeat: int
    warmup: int = 2


FULL = Sizes(
    big=(20, 5_000_000), small=(2000, 1000), mlp=(256, 8, 64), fused=(24, 500_000), repeat=15
)
QUICK = Sizes(big=(4, 20_000), small=(40, 100), mlp=(16, 2, 4), fused=(4, 1000), repeat=3, warmup=1)


@dataclass
class Row:
    name: str
    times: dict[str, list[float]] = field(default_factory=dict)

    def median(self, variant: str) -> float:
        return statistics.median(self.times[variant])

    def ratio(self, num: str, den: str) -> float:
        return self.median(num) / self.median(den)


def measure(name: str, variants: dict[str, Variant], sizes: Sizes, device: torch.device) -> Row:
    """Round-robin timing of ``variants`` (seconds), rotating the order every round."""
    row = Row(name, {key: [] for key in variants})
    keys = list(variants)
    for rnd in range(sizes.warmup + sizes.repeat):
        order = keys[rnd % len(keys) :] + keys[: rnd % len(keys)]
        for key in order:
            before, timed, after = variants[key]
            if before is not None:
                before()
            _sync(device)
            start = time.perf_counter()
            timed()
            _sync(device)
            elapsed = time.perf_counter() - start
            if after is not None:
                after()
            if rnd >= sizes.warmup:
                row.times[key].append(elapsed)
    return row


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_params(count: int, numel: int, device: torch.device, flat: bool) -> list:
    """``count`` parameters of ``numel`` elements with N(0, 1) grads (flat ones if asked)."""
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter(torch.empty(numel, device=device)) for _ in range(count)]
    if flat:
        for buffer in mixprec.flatten_grads(params).buffers.values():
            buffer.normal_(generator=gen)
    else:
        for p in params:
            p.grad = torch.randn(numel, device=device, generator=gen)
    return params


def scalers(device: torch.device) -> tuple[mixprec.GradScaler, torch.amp.GradScaler]:
    """Both scalers at scale 1, never growing, with their scale created."""
    kwargs = {"init_scale": 1.0, "growth_interval": 10**9}
    ours = mixprec.GradScaler(device.type, **kwargs)
    theirs = torch.amp.GradScaler(device.type, **kwargs)
    for scaler in (ours, theirs):
        scaler.scale(torch.ones((), device=device))
    return ours, theirs


def floor_pass(params: list) -> Step:
    grads = [p.grad for p in params]
    one = torch.ones((), device=grads[0].device)
    return lambda: torch._foreach_mul_(grads, one)


def unscale_row(name: str, params: list, sizes: Sizes, device: torch.device) -> Row:
    opt = torch.optim.SGD(params, lr=0.0)
    ours, theirs = scalers(device)
    return measure(
        name,
        {
            "mixprec": (None, lambda: ours.unscale_(opt), ours.update),
            "torch": (None, lambda: theirs.unscale_(opt), theirs.update),
            "floor": (None, floor_pass(params), None),
        },
        sizes,
        device,
    )


def clip_row(name: str, params: list, sizes: Sizes, device: torch.device) -> Row:
    opt = torch.optim.SGD(params, lr=0.0)
    ours, theirs = scalers(device)

    def torch_sequence() -> None:
        theirs.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, 1.0)

    return measure(
        name,
        {
            "mixprec": (None, lambda: ours.clip_grad_norm_(opt, 1.0), ours.update),
            "torch": (None, torch_sequence, theirs.update),
            "floor": (None, floor_pass(params), None),
        },
        sizes,
        device,
    )


def folded_clip_row(sizes: Sizes, device: torch.device) -> Row:
    """Clipping inside a fused AdamW step against torch's unscale_ + clip + fused step."""
    count, numel = sizes.fused
    variants: dict[str, Variant] = {}
    for key in ("mixprec", "torch", "floor"):
        params = make_params(count, numel, device, flat=False)
        saved = [p.grad.clone() for p in params]
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
        ours, theirs = scalers(device)
        restore = _restorer(params, saved)
        if key == "mixprec":
            variants[key] = (restore, _mixprec_folded(ours, opt), None)
        elif key == "torch":
            variants[key] = (restore, _torch_clip_step(theirs, opt, params), None)
        else:
            variants[key] = (restore, opt.step, None)
    label = f"{count * numel / 1e6:g}M params in {count} tensors"
    return measure(f"clip in step + fused AdamW: {label}", variants, sizes, device)


def _restorer(params: list, saved: list) -> Step:
    grads = [p.grad for p in params]
    return lambda: torch._foreach_copy_(grads, saved)


def _mixprec_folded(scaler: mixprec.GradScaler, opt: torch.optim.Optimizer) -> Step:
    def step() -> None:
        scaler.clip_grad_norm_(opt, 1.0, in_step=True)
        scaler.step(opt)
        scaler.update()

    return step


def _torch_clip_step(
    scaler: torch.amp.GradScaler, opt: torch.optim.Optimizer, params: list
) -> Step:
    def step() -> None:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        scaler.step(opt)
        scaler.update()

    return step


def folded_accuracy(
    device: torch.device, steps: int = 100, fp16: bool = False
) -> tuple[str, float, bool]:
    """Folded against unfolded clipping over ``steps`` fused AdamW steps with injected overflows:
    ``(summary, max |param difference|, same skip decisions)``.

    With an fp32 forward the difference is the folding's own (the kernel divides by
    ``scale / c`` where the unfolded path multiplies by ``c / scale``). Under fp16 autocast it
    is dominated by the fp16 rounding of activations, which a last-bit change in a parameter can
    flip, and grows with the steps (printed for information).
    """
    runs = [_clipped_run(device, in_step, steps, fp16) for in_step in (True, False)]
    diff = max(float((a - b).abs().max()) for a, b in zip(runs[0][1], runs[1][1], strict=True))
    same = runs[0][0] == runs[1][0]
    text = (
        f"Clip in step vs scaler.clip_grad_norm_ then step, {steps} fused AdamW steps "
        f"({'fp16 autocast' if fp16 else 'fp32'}, {sum(runs[0][0])} skipped): max |param diff| "
        f"{diff:.2e}, skip decisions {'identical' if same else 'DIFFERENT'}."
    )
    return text, diff, same


def _clipped_run(
    device: torch.device, in_step: bool, steps: int, fp16: bool
) -> tuple[list[bool], list]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = mixprec.GradScaler(device.type, growth_interval=10)
    gen = torch.Generator().manual_seed(1)
    skipped = []
    for it in range(steps):
        x = torch.randn(64, 32, generator=gen).to(device)
        with torch.autocast(device.type, dtype=torch.float16, enabled=fp16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        if it % 17 == 5:
            with torch.no_grad():
                model[2].weight.grad[0, 0] = math.inf
        scaler.clip_grad_norm_(opt, 0.1, in_step=in_step)
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.last_step_skipped())
        opt.zero_grad()
    return skipped, [p.detach().cpu() for p in model.parameters()]


def training_row(sizes: Sizes, device: torch.device) -> Row:
    """A small fp16-autocast MLP: the timed part is what the scaler adds after backward."""
    width, depth, batch = sizes.mlp
    torch.manual_seed(0)
    layers = [m for _ in range(depth) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())]
    base = torch.nn.Sequential(*layers).to(device)
    x = torch.randn(batch, width, device=device)
    variants: dict[str, Variant] = {}
    for key in ("mixprec", "torch", "floor"):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9, foreach=True)
        cls = {"mixprec": mixprec.GradScaler, "torch": torch.amp.GradScaler}.get(key)
        scaler = None if cls is None else cls(device.type)
        variants[key] = _training_variant(model, opt, scaler, x)
    # A round is a few milliseconds and the differences are a few percent: many more rounds.
    rounds = dataclasses.replace(sizes, repeat=sizes.repeat * TRAINING_ROUNDS)
    return measure(
        f"train step: scaler step+update (MLP {width}x{depth})", variants, rounds, device
    )


#: The training row runs this many times the rounds of the others.
TRAINING_ROUNDS = 40


def _training_variant(
    model: torch.nn.Module, opt: torch.optim.Optimizer, scaler: object, x: torch.Tensor
) -> Variant:
    def backward() -> None:
        opt.zero_grad()
        with torch.autocast(x.device.type, dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        (loss if scaler is None else scaler.scale(loss)).backward()  # type: ignore[attr-defined]

    if scaler is None:
        one = torch.ones((), device=x.device)

        def plain() -> None:
            torch._foreach_mul_([p.grad for p in model.parameters()], one)
            opt.step()

        return backward, plain, None

    def scaled() -> None:
        scaler.step(opt)  # type: ignore[attr-defined]
        scaler.update()  # type: ignore[attr-defined]

    return backward, scaled, None


def run_suite(sizes: Sizes, device: torch.device) -> list[Row]:
    """Every row, big tensors first (then freed), on ``device``."""
    rows = []
    count, numel = sizes.big
    big = make_params(count, numel, device, flat=False)
    label = f"{count * numel / 1e6:g}M elements in {count} tensors"
    rows.append(unscale_row(f"unscale+check (a): {label}", big, sizes, device))
    rows.append(clip_row(f"unscale+clip_grad_norm_: {label}", big, sizes, device))
    del big
    count, numel = sizes.small
    label = f"{count} tensors x {numel}"
    small = make_params(count, numel, device, flat=False)
    rows.append(unscale_row(f"unscale+check (b): {label}", small, sizes, device))
    del small
    flat = make_params(count, numel, device, flat=True)
    rows.append(unscale_row(f"unscale+check (c): {label}, flat", flat, sizes, device))
    rows.append(clip_row(f"unscale+clip_grad_norm_: {label}, flat", flat, sizes, device))
    del flat
    rows.append(folded_clip_row(sizes, device))
    rows.append(training_row(sizes, device))
    return rows


def header(device: torch.device, sizes: Sizes) -> str:
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    load = ""
    if hasattr(os, "getloadavg"):
        load = ", load average {:.1f} {:.1f} {:.1f}".format(*os.getloadavg())
    return (
        f"mixprec {mixprec.__version__} | torch {torch.__version__} | python "
        f"{platform.python_version()} | device {device} ({where or platform.machine()}) | "
        f"threads {torch.get_num_threads()} | {sizes.repeat} rounds "
        f"({sizes.repeat * TRAINING_ROUNDS} for the train step), medians{load}"
    )


def table(rows: list[Row]) -> str:
    lines = [
        "| benchmark | mixprec ms | torch ms | floor ms | torch / mixprec | mixprec / floor |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        m, t, f = (row.median(k) * 1e3 for k in ("mixprec", "torch", "floor"))
        lines.append(f"| {row.name} | {m:.3f} | {t:.3f} | {f:.3f} | {t / m:.2f}x | {m / f:.2f}x |")
    return "\n".join(lines)


def targets(rows: list[Row]) -> list[str]:
    """The issue's targets, as met / not met (informative; nothing fails on them)."""
    by_prefix = {
        row.name.split(":")[0] + (" flat" if "flat" in row.name else ""): row for row in rows
    }
    check = [
        (
            "unscale+clip >= 1.4x faster than torch (big)",
            by_prefix["unscale+clip_grad_norm_"].ratio("torch", "mixprec") >= 1.4,
        ),
        (
            "clip in step + fused AdamW >= 1.4x faster than torch's unscale_+clip+step",
            by_prefix["clip in step + fused AdamW"].ratio("torch", "mixprec") >= 1.4,
        ),
        (
            "train step not slower than torch",
            by_prefix["train step"].ratio("torch", "mixprec") >= 1.0,
        ),
        (
            "flat small tensors >= 2x faster than torch",
            by_prefix["unscale+check (c) flat"].ratio("torch", "mixprec") >= 2.0,
        ),
        (
            "unscale+check (a) within 1.05x of the floor",
            by_prefix["unscale+check (a)"].ratio("mixprec", "floor") <= 1.05,
        ),
        (
            "unscale+check (a) not slower than torch",
            by_prefix["unscale+check (a)"].ratio("torch", "mixprec") >= 1.0,
        ),
        (
            "unscale+check (b) not slower than torch",
            by_prefix["unscale+check (b)"].ratio("torch", "mixprec") >= 1.0,
        ),
    ]
    return [f"- {text}: {'met' if ok else 'NOT met'}" for text, ok in check]


def other_benchmarks(threads: int) -> None:
    """Run the other ``bench_*.py`` scripts of this folder, each in its own process."""
    for script in sorted(Path(__file__).parent.glob("bench_*.py")):
        print(f"\n## {script.name}\n", flush=True)
        cmd = [sys.executable, str(script), "--threads", str(threads)]
        done = subprocess.run(cmd, check=False)
        if done.returncode:
            print(f"({script.name} exited with status {done.returncode})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (2)")
    parser.add_argument("--repeat", type=int, default=None, help="timed rounds per row")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--no-others", action="store_true", help="skip benchmarks/bench_*.py")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = QUICK if args.quick else FULL
    if args.repeat is not None:
        sizes = dataclasses.replace(sizes, repeat=args.repeat)
    device = torch.device(args.device)
    print(f"# mixprec benchmarks{' (quick: sizes too small to mean anything)' * args.quick}\n")
    print(header(device, sizes) + "\n", flush=True)
    rows = run_suite(sizes, device)
    print(table(rows))
    for fp16 in (False, True):
        print(
            ("\n" if not fp16 else "") + folded_accuracy(device, 10 if args.quick else 100, fp16)[0]
        )
    if not args.quick:
        print("\nTargets (issue 5 / issue 2):")
        print("\n".join(targets(rows)))
        if not args.no_others:
            other_benchmarks(args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
