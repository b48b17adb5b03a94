"""The precision advisor's targets, measured: cost, fp8 on the small GPT, fp16 on a loud layer.

Printed, side by side in one run (threads pinned, load average shown since the machine may be
shared):

1. Cost of an advice on the GPT-like model of ``examples/advise_gpt.py`` (2 blocks, width 256,
   9 Linear layers): median wall time of ``mixprec.advise`` over repeats, against one float32
   forward+backward of the same model (the floor: an advice is at least ``passes`` of them).
2. The fp8 target for each recipe: all-fp8, the proposal for ``min_sqnr=30, keep_at_most=2``
   (kept modules, predicted, measured with the policy applied), and the per-module impact next to
   an independent oracle, torchao's emulated Float8Linear swapped in for one layer at a time in
   a float32 model (when torchao is installed; it is a test-only dependency).
3. The fp16 target: the layer whose activations exceed fp16 is named; 50 steps with the proposal
   and its ``init_scale`` against float32 and against all-fp16 with torch's default scaler.
4. Determinism: the repeats' JSON reports are identical.
5. The watch's overhead: training steps of the GPT with its fp8 proposal and checks of
   ``mixprec.Watch`` (``sample=1``, the default: two passes; the first check of each module,
   with its 16-bit pass, runs before) interleaved; the overhead at ``every=100`` is the median
   check over 100 median steps.
6. (full mode) ``objective="speed"`` on a wider GPT (width 1024, 2048 tokens, vocab 8192) for
   ``gpu="h100"`` and ``"b200"``: what the fastest policy meeting 25 dB keeps, its predicted
   speedup against bf16, against the fewest-kept proposal's.
7. The fastest policy without a target (``objective="speed", gpu="b200"``) on the GPT of
   ``examples/advise_gpt.py`` at 16,384 tokens: one reference pass gives the GEMM shapes, the
   speed model predicts every option from them, one pass measures the policy: wall and CPU time.

Run: ``python benchmarks/bench_advisor.py [--threads 2] [--repeats 3] [--quick]``.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import mixprec

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ("fp8", "fp8:rowwise", "fp8:rowwise_gw_hp")


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("advise_gpt", ROOT / "examples" / "advise_gpt.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def _fp32_pass_s(model: nn.Module, batch: Any, loss_fn: Any, repeats: int = 3) -> float:
    twin = copy.deepcopy(model)
    times = []
    for _ in range(repeats + 1):
        twin.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss_fn(twin, batch).backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def cost(task: Any, repeats: int) -> list[list[mixprec.types.Advice]]:
    """Wall and CPU time of an advice; each repeat is paired with a float32 pass measured just
    before it (the ratio of the two cancels most of the load drift of a shared machine)."""
    model, batch, loss_fn = task
    rows, reports = [], []
    for per_matmul, check in ((False, False), (False, True), (True, False), (True, True)):
        walls, cpus, ratios = [], [], []
        reports.append([])
        for _ in range(repeats):
            unit = _fp32_pass_s(model, batch, loss_fn)
            start, cpu = time.perf_counter(), time.process_time()
            advice = mixprec.advise(
                model,
                batch,
                loss_fn,
                candidates=["fp8"],
                min_sqnr=30.0,
                keep_at_most=2,
                check=check,
                per_matmul=per_matmul,
            )
            walls.append(time.perf_counter() - start)
            cpus.append(time.process_time() - cpu)
            ratios.append(walls[-1] / unit)
            reports[-1].append(advice)
        ratio = statistics.median(ratios)
        mode = "per matmul" if per_matmul else "per module"
        rows.append(
            f"| advise, {mode}{' + check' if check else ''} | {advice.passes} | "
            f"{statistics.median(walls):.2f} | {min(walls):.2f} | {min(cpus):.2f} | "
            f"{ratio:.1f} | {ratio / advice.passes:.2f} |"
        )
    print(
        "| mode | passes | wall s (median) | wall s (min) | CPU s (min, all threads) | "
        "wall / fp32 pass (paired, median) | / passes |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    return reports


def _torchao_impact(task: Any, recipe: str) -> dict[str, float] | None:
    try:
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        return None
    name = {"fp8": "tensorwise", "fp8:rowwise": "rowwise"}.get(recipe, "rowwise_with_gw_hp")
    config = Float8LinearConfig.from_recipe_name(name)
    config = Float8LinearConfig(**{**config.__dict__, "emulate": True})
    model, batch, loss_fn = task

    def grads(m: nn.Module) -> torch.Tensor:
        m.zero_grad(set_to_none=True)
        loss_fn(m, batch).backward()
        return torch.cat([p.grad.flatten().double() for p in m.parameters()])

    ref = grads(copy.deepcopy(model))
    out = {}
    for lin_name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            twin = copy.deepcopy(model)
            parent, _, child = lin_name.rpartition(".")
            holder = twin.get_submodule(parent) if parent else twin
            setattr(holder, child, Float8Linear.from_float(getattr(holder, child), config=config))
            g = grads(twin)
            out[lin_name] = 10 * math.log10(float((ref**2).sum() / ((g - ref) ** 2).sum()))
    return out


def fp8_targets(task: Any, recipes: tuple[str, ...]) -> None:
    model, batch, loss_fn = task
    print("\n| recipe | all fp8 (pred.) | kept | predicted | measured | meas. - pred. | met |")
    print("|---|---:|---|---:|---:|---:|---|")
    impacts = {}
    for recipe in recipes:
        a = mixprec.advise(
            model, batch, loss_fn, candidates=[recipe], min_sqnr=30.0, keep_at_most=2, check=True
        )
        noise = 10 ** (-a.region_sqnr / 10) + sum(
            10 ** (-m.measurements[0].model_grad_sqnr / 10) for m in a.modules
        )
        assert a.measured_sqnr is not None
        print(
            f"| {recipe} | {-10 * math.log10(noise):.2f} | {', '.join(a.kept) or '-'} | "
            f"{a.predicted_sqnr:.2f} | {a.measured_sqnr:.2f} | "
            f"{a.measured_sqnr - a.predicted_sqnr:+.2f} | {a.met} |"
        )
        impacts[recipe] = a
    for recipe, a in impacts.items():
        oracle = _torchao_impact(task, recipe)
        print(f"\nper-module whole-model gradient SQNR, {recipe} alone (dB):\n")
        print("| module | mixprec.advise | torchao Float8Linear (emulate, fp32 around) |")
        print("|---|---:|---:|")
        for m in a.modules:
            ref = "-" if oracle is None else f"{oracle[m.name]:.2f}"
            print(f"| {m.name} | {m.measurements[0].model_grad_sqnr:.2f} | {ref} |")


def _train(model: nn.Module, batch: Any, loss_fn: Any, **region: Any) -> tuple[float, int]:
    model = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    enabled = region.pop("enabled", True)
    scaler = mixprec.GradScaler(
        "cpu", init_scale=region.pop("init_scale", 65536.0), enabled=enabled
    )
    loss = torch.zeros(())
    for _ in range(50):
        opt.zero_grad(set_to_none=True)
        with mixprec.autocast("cpu", enabled=enabled, **region):
            loss = loss_fn(model, batch)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return float(loss.detach()), scaler.stats().steps_skipped if enabled else 0


def fp16_target() -> None:
    import warnings

    sys.path.insert(0, str(ROOT))
    from tests.advisor_models import loud_task

    model, batch, loss_fn = loud_task()
    a = mixprec.advise(model, batch, loss_fn, candidates=["fp16"], check=True)
    fp32, _ = _train(model, batch, loss_fn, enabled=False)
    prop, skipped = _train(
        model, batch, loss_fn, dtype=a.dtype, policy=a.policy, init_scale=a.init_scale
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mixprec.errors.ScaleCollapseWarning)
        low, low_skipped = _train(model, batch, loss_fn, dtype=torch.float16)
    print(
        f"\nfp16 target: kept {a.kept} ({a.modules[1].reason}); policy {a.policy}, "
        f"init_scale {a.init_scale:g}\n"
    )
    print("| run (50 steps, Adam 3e-3) | final loss | / fp32 | skipped steps |")
    print("|---|---:|---:|---:|")
    print(f"| fp32 | {fp32:.5f} | 1 | - |")
    print(f"| proposal + GradScaler(init_scale) | {prop:.5f} | {prop / fp32:.4f} | {skipped} |")
    print(f"| all fp16 + GradScaler() | {low:.5f} | {low / fp32:.4f} | {low_skipped} |")


def watch_overhead(task: Any, rounds: int) -> float:
    """Interleave training steps and watch checks; print medians and the overhead at 100."""
    model, batch, loss_fn = task
    model = copy.deepcopy(model)
    advice = mixprec.advise(
        model, batch, loss_fn, candidates=["fp8"], min_sqnr=30.0, keep_at_most=2
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    watch = mixprec.Watch(model, loss_fn, advice, every=1)

    def train_step() -> None:
        opt.zero_grad(set_to_none=True)
        with mixprec.autocast("cpu", dtype=advice.dtype, policy=advice.policy):
            loss = loss_fn(model, batch)
        loss.backward()
        opt.step()

    steps, checks = [], []
    train_step()  # warm-up
    for _ in advice.modules:  # each module once, with its first 16-bit pass
        watch.step(batch)
    for _ in range(rounds):
        for _ in range(5):
            start = time.perf_counter()
            train_step()
            steps.append(time.perf_counter() - start)
        start = time.perf_counter()
        watch.step(batch)
        checks.append(time.perf_counter() - start)
    step, check = statistics.median(steps), statistics.median(checks)
    overhead = check / (100 * step)
    print(
        f"\nwatch (sample=1, {rounds} checks after each module's first, {5 * rounds} steps "
        f"interleaved): training step "
        f"{step * 1e3:.0f} ms, check {check * 1e3:.0f} ms ({check / step:.1f} steps); "
        f"overhead at every=100: {100 * overhead:.1f}% (every=50: {200 * overhead:.1f}%); "
        f"the 5% goal: {'met' if overhead <= 0.05 else 'NOT met'}"
    )
    return overhead


def speed_objective(ex: Any) -> None:
    """The fastest policy on a wider GPT, per GPU."""
    torch.manual_seed(0)
    model = ex.GPT(vocab=8192, width=1024, depth=2, heads=16, seq=128)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 8192, (16, 129), generator=gen)
    batch = (tokens[:, :-1], tokens[:, 1:])
    print("\n| gpu | objective | kept | predicted dB | step µs | bf16 µs | speedup |")
    print("|---|---|---|---:|---:|---:|---:|")
    for gpu in ("h100", "b200"):
        for objective in ("fewest_kept", "speed"):
            a = mixprec.advise(
                model,
                batch,
                ex.next_token_loss,
                candidates=["fp8"],
                min_sqnr=25.0,
                gpu=gpu,
                objective=objective,
            )
            assert a.step is not None
            print(
                f"| {gpu} | {objective} | {', '.join(a.kept) or '-'} | {a.predicted_sqnr:.1f} | "
                f"{a.step.proposal * 1e6:.0f} | {a.step.baseline * 1e6:.0f} | "
                f"{a.step.speedup:.2f}x |"
            )


def speed_once(ex: Any) -> float:
    """``objective="speed"`` without a target at 16,384 tokens: seconds of CPU time."""
    model, batch, loss_fn = ex.make_gpt(batch=256)
    wall, cpu = time.perf_counter(), time.process_time()
    advice = mixprec.advise(model, batch, loss_fn, objective="speed", gpu="b200")
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(
        f"\nobjective='speed', gpu='b200', no target, {batch[0].numel()} tokens: "
        f"{advice.passes} passes, wall {wall:.1f} s, CPU {cpu:.1f} s (load {_load()}); "
        f"policy: {str(advice.policy) or '(no rules)'}"
    )
    return cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a narrow GPT, one repeat, tensorwise")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    width = {"width": 64} if args.quick else {}
    ex = _example()
    torch.manual_seed(0)
    task = ex.make_gpt() if not args.quick else _narrow(ex, **width)
    print(f"torch {torch.__version__}, threads {args.threads}, load average {_load()} at start\n")
    print(
        f"one float32 forward+backward of the model: {_fp32_pass_s(*task, repeats=5) * 1e3:.0f} ms"
        " (median of 5, now)\n"
    )
    reports = cost(task, 1 if args.quick else args.repeats)
    fp8_targets(task, RECIPES[:1] if args.quick else RECIPES)
    fp16_target()
    watch_overhead(task, 2 if args.quick else 4)
    if not args.quick:
        speed_objective(ex)
        speed_once(ex)
    same = all(len({r.to_json() for r in group}) == 1 for group in reports)
    print(f"\ndeterministic: {'yes' if same else 'NO'} (JSON of the repeated runs)")
    print(f"load average {_load()} at the end")
    return 0 if same else 1  # timings are printed against their goals, never an exit status


def _narrow(ex: Any, width: int) -> Any:
    model = ex.GPT(width=width)
    _, batch, loss_fn = ex.make_gpt()
    return model, batch, loss_fn


if __name__ == "__main__":
    raise SystemExit(main())
