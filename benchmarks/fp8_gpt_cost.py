"""What the fp8 emulation costs on a small GPT, whole training step, against fp32 and bf16.

benchmarks/bench_fp8.py times one Linear-GELU-Linear MLP; this times the step of the GPT of
examples/advise_gpt.py (2 pre-norm blocks, 4 heads, context 64, vocab 256, 8 x 64 tokens: the
model and batch of benchmarks/fp8_gpt_gap.py at its default width 128), where attention, norms,
embeddings and the loss run beside the Linears, with every Linear in the recipe inside a bf16
region. Forward+backward (no optimizer), all configurations in one process, shuffled rounds,
medians, one thread.

Run: ``python benchmarks/fp8_gpt_cost.py [--width 128] [--rounds 15]``.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time
from pathlib import Path

import torch

import mixprec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from examples.advise_gpt import GPT, next_token_loss

RULES = ("fp8", "fp8:rowwise", "fp8:rowwise_gw_hp", "fp8:blockwise", "mxfp8", "nvfp4")


def step(
    model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor], rule: str | None
) -> None:
    model.zero_grad(set_to_none=True)
    if rule is None:
        loss = next_token_loss(model, batch)
    else:
        policy = f"nn.Linear={rule}" if rule != "bf16" else None
        with mixprec.autocast("cpu", torch.bfloat16, policy=policy):
            loss = next_token_loss(model, batch)
    loss.backward()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(vocab=256, width=args.width, depth=2, heads=4, seq=64)
    tokens = torch.randint(0, 256, (8, 65))
    batch = (tokens[:, :-1], tokens[:, 1:])
    rules: list[str | None] = [
        None,
        "bf16",
        *(r for r in RULES if args.width % 128 == 0 or r != "fp8:blockwise"),
    ]
    models = {r: copy.deepcopy(model) for r in rules}
    for r in rules:  # warm-up
        step(models[r], batch, r)
    times: dict[str | None, list[float]] = {r: [] for r in rules}
    for _ in range(args.rounds):
        random.shuffle(rules)
        for r in rules:
            t0 = time.perf_counter()
            step(models[r], batch, r)
            times[r].append(time.perf_counter() - t0)
    med = {r: statistics.median(v) for r, v in times.items()}
    print(f"torch {torch.__version__}, 1 thread, GPT width {args.width}, 2 blocks, 8 x 64 tokens")
    print("| configuration | ms | /fp32 | /bf16 |\n|---|---:|---:|---:|")
    for r in (None, "bf16", *RULES):
        if r in med:
            t = med[r]
            print(
                f"| {r or 'fp32'} | {t * 1e3:.1f} | {t / med[None]:.2f} | {t / med['bf16']:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
