"""Precision per matmul and per phase of training, on the small GPT of fp8_gpt_gap.py.

The same byte-level GPT, data, optimizer and schedule of learning rates as
``benchmarks/fp8_gpt_gap.py`` (2 blocks, context 64, 8 sequences a step, 150 steps), at width
1024 by default: at fp8_gpt_gap.py's width 128 every GEMM of this GPT is memory-bound on a B200,
the speed model predicts bf16 fastest for every module, and a comparison at equal predicted
speed would be bf16 against bf16. The same initialisation and batches for every configuration
of one seed:

- ``bf16``: bf16 autocast, the baseline; ``nvfp4``: every Linear in nvfp4 throughout;
- ``per-module``: ``mixprec.advise(..., per_matmul=False, gpu="b200", objective="speed")`` with
  the candidates ``["nvfp4", "mxfp8", "bf16"]`` and the target of fp8_gpt_gap.py (all-nvfp4's
  measured gradient SQNR + 6 dB): the fastest policy on a B200 whose modules each take one
  format;
- ``per-matmul``: ``mixprec.advise(..., objective="sqnr", min_speedup=S)`` with S the
  per-module policy's predicted speedup: the most precise policy at the same predicted speed,
  each Linear's fprop, dgrad and wgrad in their own format;
- ``schedule``: nvfp4 for the first 85% of the steps, then the forward matmuls in bf16
  (``Policy("nn.Linear=nvfp4").with_matmuls(fprop="bf16")``, a :class:`mixprec.Schedule`).

The advisor measures on a batch of 32 sequences (2,048 tokens, taken from the training data: the
speed model's GEMM shapes; at the 512 training tokens every GEMM is near the kernel floor). It
prints the loss gaps to bf16 (held-out after the last step, training loss of the last 10%; per
seed, then averaged with the spread), the two policies with their predicted SQNR and speedup,
which matmul carries each module's error (seed 0's per-matmul advice), and the schedule's gap to
bf16 before the switch (held-out at 85%, training loss over 75-85%) and after it (the end),
against nvfp4 throughout.

Run: ``python benchmarks/fp8_per_matmul.py [--steps 150] [--seeds 0 1 2] [--jobs 3]``
(``--save``/``--merge`` as fp8_gpt_gap.py). docs/per-matmul.md has the figures and conditions.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import mixprec


def _gap_module() -> Any:
    path = Path(__file__).resolve().parent / "fp8_gpt_gap.py"
    spec = importlib.util.spec_from_file_location("fp8_gpt_gap", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("fp8_gpt_gap", module)
    spec.loader.exec_module(module)
    return module


GAP = _gap_module()
CANDIDATES = ["nvfp4", "mxfp8", "bf16"]
NAMES = ("bf16", "nvfp4", "per-module", "per-matmul", "schedule")
SWITCH = 0.85


def advise_both(args: argparse.Namespace, seed: int, big: Any) -> dict[str, Any]:
    """The per-module policy (fastest at the target) and the per-matmul one (most precise at
    its predicted speedup), with their figures."""
    model = GAP.make_model(args, seed)
    probe = mixprec.advise(model, big, GAP.loss_fn, candidates=["nvfp4"], check=True)
    assert probe.measured_sqnr is not None
    target = probe.measured_sqnr + args.margin
    common: dict[str, Any] = dict(candidates=CANDIDATES, gpu=args.gpu, check=True)
    whole = mixprec.advise(
        model, big, GAP.loss_fn, per_matmul=False, objective="speed", min_sqnr=target, **common
    )
    assert whole.step is not None
    split = mixprec.advise(
        model, big, GAP.loss_fn, objective="sqnr", min_speedup=whole.step.speedup, **common
    )
    assert split.step is not None
    return {"target": target, "per-module": whole, "per-matmul": split}


def _figures(advice: Any) -> dict[str, Any]:
    return {
        "policy": str(advice.policy),
        "predicted": advice.predicted_sqnr,
        "measured": advice.measured_sqnr,
        "speedup": advice.step.speedup,
        "met": advice.met,
    }


def carriers(advice: Any) -> list[str]:
    """Per module and recipe, the SQNR of each matmul alone: the table lines."""
    lines = ["| module | recipe | fprop | dgrad | wgrad | carries | choice |", "|---" * 7 + "|"]
    for m in advice.modules:
        for x in m.measurements:
            if x.matmuls is None:
                continue
            worst = ("fprop", "dgrad", "wgrad")[min(range(3), key=lambda i: x.matmuls[i])]
            cells = " | ".join(f"{d:.1f}" for d in x.matmuls)
            lines.append(f"| {m.name} | {x.candidate} | {cells} | {worst} | {m.choice} |")
    return lines


def run_seed(seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every configuration for one seed: name -> figures (plain data, for a worker)."""
    torch.set_num_threads(args.threads)
    train_bytes, val_bytes = GAP.corpus()
    gen = torch.Generator().manual_seed(99)
    val = [GAP.sample(val_bytes, 32, args.seq, gen) for _ in range(8)]
    data = GAP.batches(args, seed, train_bytes)
    nvfp4 = mixprec.Policy("nn.Linear=nvfp4")
    switch = round(SWITCH * args.steps)
    policies: dict[str, Any] = {
        "bf16": None,
        "nvfp4": nvfp4,
        "schedule": mixprec.Schedule({0: nvfp4, switch: nvfp4.with_matmuls(fprop="bf16")}),
    }
    out: dict[str, Any] = {"switch": switch}
    if {"per-module", "per-matmul"} & set(args.names):
        gen = torch.Generator().manual_seed(seed)
        big = GAP.sample(train_bytes, args.advise_batch, args.seq, gen)
        advices = advise_both(args, seed, big)
        policies.update({k: advices[k].policy for k in ("per-module", "per-matmul")})
        out["target"] = advices["target"]
        out.update({f"advice:{k}": _figures(advices[k]) for k in ("per-module", "per-matmul")})
        if seed == args.seeds[0]:
            out["carriers"] = carriers(advices["per-matmul"])
    for name in args.names:
        start = time.perf_counter()
        losses: list[float] = []
        at = {switch: float("nan")}
        held, tail = GAP.train(policies[name], seed, args, data, val, losses, at)
        before = losses[round(0.75 * args.steps) : switch] or losses[:switch]
        out[name] = {
            "held": held,
            "tail": tail,
            "held_at_switch": at[switch],
            "before": statistics.fmean(before),
            "step_s": (time.perf_counter() - start) / args.steps,
        }
        print(f"seed {seed} {name}: held-out {held:.4f}, train {tail:.4f}", flush=True)
    return out


def _mean_gap(results: list[dict[str, Any]], name: str, key: str) -> str:
    gaps = [r[name][key] - r["bf16"][key] for r in results]
    rel = 100 * statistics.fmean(g / r["bf16"][key] for g, r in zip(gaps, results, strict=True))
    spread = f" ± {statistics.stdev(gaps):.3f}" if len(gaps) > 1 else ""
    per = ", ".join(f"{g:+.3f}" for g in gaps)
    return f"{statistics.fmean(gaps):+.3f}{spread} ({rel:+.2f}%; per seed {per})"


def report(results: list[dict[str, Any]], seeds: list[int], names: list[str]) -> None:
    print("\n| configuration | held-out gap to bf16 | train gap to bf16 (last 10%) |")
    print("|---|---|---|")
    for name in names[1:]:
        print(
            f"| {name} | {_mean_gap(results, name, 'held')} | {_mean_gap(results, name, 'tail')} |"
        )
    advised = [n for n in ("per-module", "per-matmul") if n in names]
    if advised:
        print("\n| seed | policy | predicted SQNR | measured | predicted speedup (B200) |")
        print("|---|---|---:|---:|---:|")
    for seed, r in zip(seeds, results, strict=True):
        for kind in advised:
            f = r[f"advice:{kind}"]
            print(
                f"| {seed} | {kind}: `{f['policy']}` | {f['predicted']:.1f} dB | "
                f"{f['measured']:.1f} dB | {f['speedup']:.3f}x |"
            )
    if "schedule" in names:
        print(f"\nschedule: nvfp4, then bf16 forward matmuls from step {results[0]['switch']}")
        print(
            "| configuration | held-out gap at the switch | train gap, 75-85% | held-out gap at "
            "the end | train gap, last 10% |"
        )
        print("|---|---|---|---|---|")
        for name in ("nvfp4", "schedule"):
            cells = [
                _mean_gap(results, name, k) for k in ("held_at_switch", "before", "held", "tail")
            ]
            print(f"| {name} | " + " | ".join(cells) + " |")
    lines = next((r["carriers"] for r in results if "carriers" in r), [])
    if lines:
        print(f"\nwhich matmul carries the error (seed {seeds[0]}, whole-model gradient SQNR, dB)")
        print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    GAP.add_run_arguments(parser, width=1024)
    parser.add_argument("--advise-batch", type=int, default=32, help="sequences the advisor sees")
    parser.add_argument("--gpu", default="b200")
    parser.add_argument("--margin", type=float, default=6.0, help="target: all-nvfp4 + this dB")
    parser.add_argument("--only", nargs="+", default=None, help="configurations besides bf16")
    parser.add_argument("--save", default=None, help="also write the per-seed figures (JSON)")
    parser.add_argument("--merge", nargs="+", default=None, help="print saved runs' tables")
    args = parser.parse_args(argv)
    args.names = ["bf16", *(n for n in NAMES[1:] if args.only is None or n in args.only)]
    if args.merge is not None:
        saved = [json.loads(Path(f).read_text()) for f in args.merge]
        print("\n".join(f"merged: {run['header']}" for run in saved))
        seeds = [s for run in saved for s in run["seeds"]]
        results = [r for run in saved for r in run["results"]]
        report(results, seeds, [n for n in args.names if all(n in r for r in results)])
        return 0
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    header = (
        f"torch {torch.__version__}, {args.threads} thread(s) per seed, {args.jobs} at once, load "
        f"{load}; GPT width {args.width}, {args.depth} blocks, context {args.seq}, batch "
        f"{args.batch}, {args.steps} steps, seeds {args.seeds}"
        + (
            f"; advised on {args.advise_batch} sequences for {args.gpu}"
            if "per-module" in args.names
            else ""
        )
    )
    print(header + "\n", flush=True)
    results = GAP.run_seeds(run_seed, args)
    GAP.save(args, header, results)
    report(results, args.seeds, args.names)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
