"""The loss gap to bf16 of each low-precision recipe on a small GPT trained on the CPU.

A byte-level GPT (the model of ``examples/advise_gpt.py``: pre-norm blocks, learned position
embeddings, an untied lm_head; here width 128, 2 blocks, 4 heads, context 64, vocab 256) is
trained on the bytes of a few Python standard-library modules (fixed list, the running Python's
copies), with AdamW, warm-up and cosine decay, the same initialisation and the same batches for
every configuration of one RNG seed:

- ``bf16``: bf16 autocast, the baseline;
- one row per recipe on **every** Linear (the lm_head included): ``fp8`` (tensorwise),
  ``fp8:rowwise``, ``fp8:blockwise``, ``mxfp8``, ``nvfp4``, inside a bf16 region;
- ``advised``: the policy ``mixprec.advise`` proposes at initialisation, on the first training
  batch, for ``candidates=["nvfp4", "mxfp8", "bf16"]`` (try fp4, then mxfp8, else keep bf16)
  and ``min_sqnr`` = the whole-model gradient SQNR that all-nvfp4 measures on that batch plus
  6 dB (``--margin``): a quarter of all-fp4's gradient noise power. If the loss gap grows with
  the gradient's noise power, that target should close about three quarters of the all-fp4 gap;
  the experiment tests that (``--min-sqnr`` sets a fixed target instead).

It prints, per configuration, the held-out loss after the last step (evaluated in float32 on
fixed validation batches, the weights as trained) and the mean training loss of the last 10% of
steps (under the recipe), each averaged over the seeds, and their gaps to bf16 with the spread
over seeds (the gap is taken per seed, the same data and initialisation on both sides), then
the advised policy and its predicted and measured SQNR.

Run: ``python benchmarks/fp8_gpt_gap.py [--steps 150] [--seeds 0 1 2] [--jobs 3]`` (each seed
in its own process on ``--threads`` threads, 1 by default; about 15 minutes of one core per seed
at the defaults, most of it nvfp4's emulation). ``--save FILE`` writes the per-seed figures,
``--merge FILE...`` prints the table of saved runs (the figures of one seed do not depend on the
others). docs/fp8.md has the figures and their conditions.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import mixprec

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ("fp8", "fp8:rowwise", "fp8:blockwise", "mxfp8", "nvfp4")
CANDIDATES = ["nvfp4", "mxfp8", "bf16"]
#: The corpus: these standard-library modules' bytes, in this order (about 600 kB).
MODULES = ("argparse", "inspect", "typing", "dataclasses", "functools", "pathlib", "textwrap")


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("advise_gpt", ROOT / "examples" / "advise_gpt.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GPT = _example().GPT


def corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) byte tensors: the last tenth of the corpus is held out."""
    lib = Path(os.__file__).parent
    data = b"".join((lib / f"{name}.py").read_bytes() for name in MODULES)
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    cut = len(tokens) * 9 // 10
    return tokens[:cut], tokens[cut:]


def sample(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> Any:
    starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
    rows = torch.stack([data[s : s + seq + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    inputs, targets = batch
    return F.cross_entropy(model(inputs).float().flatten(0, 1), targets.flatten())


def make_model(args: argparse.Namespace, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return GPT(vocab=256, width=args.width, depth=args.depth, heads=4, seq=args.seq)


def batches(args: argparse.Namespace, seed: int, train: torch.Tensor) -> list[Any]:
    gen = torch.Generator().manual_seed(1000 + seed)
    return [sample(train, args.batch, args.seq, gen) for _ in range(args.steps)]


def lr_at(step: int, args: argparse.Namespace) -> float:
    warm = max(1, args.steps // 15)
    if step < warm:
        return args.lr * (step + 1) / warm
    progress = (step - warm) / max(1, args.steps - warm)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def held_out(model: torch.nn.Module, val: list[Any]) -> float:
    """The mean loss on the validation batches, in float32."""
    with torch.no_grad():
        return statistics.fmean(float(loss_fn(model, b)) for b in val)


def train(
    policy: str | mixprec.Policy | mixprec.Schedule | None,
    seed: int,
    args: argparse.Namespace,
    data: list[Any],
    val: list[Any],
    losses: list[float] | None = None,
    at: dict[int, float] | None = None,
) -> tuple[float, float]:
    """(held-out loss in float32 after the last step, mean training loss of the last 10%);
    a :class:`mixprec.Schedule` gives each step its policy. ``losses`` receives every step's
    training loss, ``at`` the held-out loss before each step it names."""
    model = make_model(args, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    torch.manual_seed(seed)  # the stochastic rounding of nvfp4's gradients draws from it
    losses = [] if losses is None else losses
    for step, batch in enumerate(data):
        if at is not None and step in at:
            at[step] = held_out(model, val)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        now = policy.at(step) if isinstance(policy, mixprec.Schedule) else policy
        with mixprec.autocast("cpu", torch.bfloat16, policy=now):
            loss = loss_fn(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            return math.nan, math.nan
    tail = losses[-max(1, len(losses) // 10) :]
    return held_out(model, val), statistics.fmean(tail)


def advise(args: argparse.Namespace, seed: int, first: Any) -> mixprec.types.Advice:
    model = make_model(args, seed)
    min_sqnr = args.min_sqnr
    if min_sqnr is None:  # the target: a quarter of all-nvfp4's gradient noise power
        probe = mixprec.advise(model, first, loss_fn, candidates=["nvfp4"], check=True)
        assert probe.measured_sqnr is not None
        min_sqnr = probe.measured_sqnr + args.margin
        print(
            f"seed {seed} all-nvfp4 on the first batch: gradient SQNR predicted "
            f"{probe.predicted_sqnr:.1f} dB, measured {probe.measured_sqnr:.1f} dB; "
            f"target {min_sqnr:.1f} dB",
            flush=True,
        )
    return mixprec.advise(
        model,
        first,
        loss_fn,
        candidates=CANDIDATES,
        min_sqnr=min_sqnr,
        check=True,
        per_matmul=False,  # each module whole (benchmarks/fp8_per_matmul.py: per matmul)
    )


def run_seed(seed: int, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every configuration for one RNG seed: name -> figures (plain data, for a worker)."""
    torch.set_num_threads(args.threads)
    train_bytes, val_bytes = corpus()
    gen = torch.Generator().manual_seed(99)
    val = [sample(val_bytes, 32, args.seq, gen) for _ in range(8)]
    data = batches(args, seed, train_bytes)
    out: dict[str, dict[str, Any]] = {}
    first = ("bf16", "nvfp4", "advised")  # the comparison that matters most runs first
    for name in sorted(args.names, key=lambda n: first.index(n) if n in first else len(first)):
        row: dict[str, Any] = {}
        if name == "advised":
            advice = advise(args, seed, data[0])
            policy: str | mixprec.Policy | None = advice.policy
            choices = [m.choice for m in advice.modules if m.served]
            row["advice"] = (
                f"min_sqnr {advice.min_sqnr:.1f} dB, predicted {advice.predicted_sqnr:.1f} dB, "
                f"measured {advice.measured_sqnr:.1f} dB; "
                + ", ".join(f"{choices.count(c)} {c}" for c in CANDIDATES)
                + f" of {len(choices)} Linears: {advice.policy}"
            )
        else:
            policy = None if name == "bf16" else f"nn.Linear={name}"
        start = time.perf_counter()
        row["held"], row["tail"] = train(policy, seed, args, data, val)
        row["step_s"] = (time.perf_counter() - start) / args.steps
        print(
            f"seed {seed} {name}: held-out {row['held']:.4f}, train {row['tail']:.4f}, "
            f"{row['step_s']:.2f} s/step",
            flush=True,
        )
        out[name] = row
    return out


def _gap(values: list[float], ref: list[float]) -> str:
    gaps = [v - r for v, r in zip(values, ref, strict=True)]
    spread = f" ± {statistics.stdev(gaps):.3f}" if len(gaps) > 1 else ""
    rel = 100 * statistics.fmean(g / r for g, r in zip(gaps, ref, strict=True))
    return f"{statistics.fmean(gaps):+.3f}{spread} | {rel:+.2f}%"


def run_seeds(run: Callable[[int, argparse.Namespace], Any], args: argparse.Namespace) -> list[Any]:
    """``run(seed, args)`` for every seed: ``args.jobs`` processes at once (spawned), or here."""
    if args.jobs > 1 and len(args.seeds) > 1:
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(min(args.jobs, len(args.seeds)), mp_context=context) as pool:
            return list(pool.map(run, args.seeds, [args] * len(args.seeds)))
    return [run(seed, args) for seed in args.seeds]


def save(args: argparse.Namespace, header: str, results: list[Any]) -> None:
    """With ``--save``, the run's header, seeds and results as JSON (``--merge`` reads them)."""
    if args.save is not None:
        Path(args.save).write_text(
            json.dumps({"header": header, "seeds": args.seeds, "results": results})
        )


def add_run_arguments(parser: argparse.ArgumentParser, width: int) -> None:
    """The model, data and run arguments (fp8_per_matmul.py takes them too)."""
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=1, help="torch threads per seed")
    parser.add_argument("--jobs", type=int, default=3, help="seeds run at once (processes)")
    parser.add_argument("--width", type=int, default=width)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser, width=128)
    parser.add_argument("--min-sqnr", type=float, default=None, help="a fixed advisor target (dB)")
    parser.add_argument(
        "--margin", type=float, default=6.0, help="target = all-nvfp4 SQNR + this (dB)"
    )
    parser.add_argument("--only", nargs="+", default=None, help="configurations besides bf16")
    parser.add_argument("--save", default=None, help="also write the per-seed figures (JSON)")
    parser.add_argument(
        "--merge", nargs="+", default=None, help="print the table of saved runs; train nothing"
    )
    args = parser.parse_args(argv)
    names = ["bf16", *RECIPES, "advised"]
    if args.only is not None:
        names = ["bf16", *(n for n in names[1:] if n in args.only)]
    args.names = names
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    train_bytes, val_bytes = corpus()
    header = (
        f"torch {torch.__version__}, Python {sys.version.split()[0]}, {args.threads} thread(s) "
        f"per seed, {args.jobs} seed(s) at once, load average {load}; GPT width {args.width}, "
        f"{args.depth} blocks, context {args.seq}, batch {args.batch}, {args.steps} steps, "
        f"lr {args.lr}, seeds {args.seeds}; corpus {len(train_bytes) + len(val_bytes)} bytes"
    )
    if args.merge is None:
        print(header + "\n", flush=True)
    if args.merge is not None:
        saved = [json.loads(Path(f).read_text()) for f in args.merge]
        args.seeds = [seed for run in saved for seed in run["seeds"]]
        results = [r for run in saved for r in run["results"]]
        names = [n for n in names if all(n in r for r in results)]
        print("\n".join(f"merged: {run['header']}" for run in saved))
    else:
        results = run_seeds(run_seed, args)
    save(args, header, results)

    def column(name: str, key: str) -> list[float]:
        return [r[name][key] for r in results]

    print(
        "\n| configuration | held-out loss | gap to bf16 | relative | train loss (last 10%) "
        "| gap to bf16 | relative | step time / bf16 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    base_held, base_tail, base_s = (
        column("bf16", "held"),
        column("bf16", "tail"),
        column("bf16", "step_s"),
    )
    for name in names:
        held, tail = column(name, "held"), column(name, "tail")
        ratio = statistics.fmean(s / b for s, b in zip(column(name, "step_s"), base_s, strict=True))
        print(
            f"| {name} | {statistics.fmean(held):.3f} | {_gap(held, base_held)} | "
            f"{statistics.fmean(tail):.3f} | {_gap(tail, base_tail)} | {ratio:.1f} |"
        )
    if "nvfp4" in names and "advised" in names:
        fp4 = [h - b for h, b in zip(column("nvfp4", "held"), base_held, strict=True)]
        adv = [h - b for h, b in zip(column("advised", "held"), base_held, strict=True)]
        closed = [1 - a / f for a, f in zip(adv, fp4, strict=True) if f > 0]
        if closed:
            print(
                f"\nthe advised policy closes {100 * statistics.fmean(closed):.0f}% of the "
                f"all-nvfp4 held-out gap (per seed: {', '.join(f'{100 * c:.0f}%' for c in closed)})"
            )
        for seed, r in zip(args.seeds, results, strict=True):
            print(f"seed {seed} advised: {r['advised']['advice']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
