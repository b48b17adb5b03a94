"""The dry run's two tables for docs/dry-run.md and docs/performance.md.

Support: ``mixprec.dry_run`` on examples/advise_gpt.py's GPT (its blocks' Linears under each
rule) for each GPU: per matmul (fprop/dgrad/wgrad) N = the GPU's kernel, E = emulated,
H = high precision, F = a kernel call that would fail; ``refused``: training refuses the rule
there (a per-matmul mix whose parts would run half in hardware, half emulated).

Memory: bytes saved for backward by one Linear (K = N = 1024, bf16 region, fp32 weights), per rule:
mixprec's recipes beside bf16 autocast and torchao.float8's same recipe, at M = 256 and 8192
tokens. Counted exactly with ``saved_tensors_hooks`` by ``mixprec.dry_run`` (meta tensors: no
data, seconds on a CPU); parameters and views of them are not counted. torchao runs its emulated
recipe on bf16 parameters (as it is used), bf16 autocast on fake CPU tensors with fp32 weights.
Each figure is also given in units of x, the bf16 input's bytes (M x K x 2).

Run: ``python benchmarks/dry_run_tables.py [--tokens 256,8192] [--width 1024]``; paste the
tables into the docs.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

import mixprec
from mixprec._src.dryrun.memory import reference_bytes
from mixprec._src.dryrun.table import human

RULES = {
    "tensorwise": "fp8",
    "rowwise": "fp8:rowwise",
    "rowwise_gw_hp": "fp8:rowwise_gw_hp",
    "blockwise": "fp8:blockwise",
    "mxfp8": "mxfp8",
    "nvfp4": "nvfp4",
}


SUPPORT_RULES = (*RULES.values(), "mxfp8/mxfp8/nvfp4", "bf16/fp8/fp8", "fp8/fp8/mxfp8")
GPUS = ("h100", "h200", "b200", "b300")
_LETTER = {"native": "N", "emulated": "E", "high precision": "H", "would fail": "F"}


def _gpt() -> Any:
    path = Path(__file__).resolve().parents[1] / "examples" / "advise_gpt.py"
    spec = importlib.util.spec_from_file_location("advise_gpt_tables", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.make_gpt(batch=2)


def support_cell(rule: str, gpu: str, made: Any) -> str:
    """``N/N/E``: per matmul, the verdicts over the blocks' Linears (several letters when they
    differ), or ``refused`` where training would refuse the rule (a ConfigError)."""
    run = mixprec.dry_run(*made, f"blocks={rule}", gpu=gpu)
    if run.error is not None:
        return "refused"
    per: dict[str, set[str]] = {}
    for (_, matmul), verdict in run.verdicts().items():
        per.setdefault(matmul, set()).add(_LETTER[verdict])
    return "/".join("".join(sorted(per.get(m, {"-"}))) for m in ("fprop", "dgrad", "wgrad"))


def support_table() -> str:
    """The markdown table rule x GPU. Host sync: none."""
    made = _gpt()
    lines = ["| rule | " + " | ".join(GPUS) + " |", "|---|" + "---|" * len(GPUS)]
    for rule in SUPPORT_RULES:
        cells = [support_cell(rule, gpu, made) for gpu in GPUS]
        lines.append(f"| `{rule}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().square().mean()


def saved(recipe: str, m: int, width: int) -> tuple[int, int, int | None]:
    """(mixprec, bf16 autocast, torchao) bytes for one Linear under ``recipe``."""
    model = nn.Sequential(nn.Linear(width, width, bias=False))
    x = torch.empty(m, width, dtype=torch.bfloat16, requires_grad=True)
    run = mixprec.dry_run(model, x, _loss, f"0={RULES[recipe]}", gpu="b200")
    (only,) = [s for s in run.saved if s.module == "0"]
    mkn = (m, width, width)
    bf16 = reference_bytes(mkn, "bf16", False)
    assert bf16 is not None
    return only.mixprec, bf16, reference_bytes(mkn, recipe, False)


def table(tokens: list[int], width: int) -> str:
    """The markdown table. Host sync: none."""
    lines = [
        "| M | recipe | mixprec | bf16 autocast | torchao |",
        "|---:|---|---:|---:|---:|",
    ]
    for m in tokens:
        x = m * width * 2
        for recipe in RULES:
            cells = [
                f"{human(b)} ({b / x:.2f}x)" if b is not None else "-"
                for b in saved(recipe, m, width)
            ]
            lines.append(f"| {m} | {recipe} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="256,8192", help="token counts, comma-separated")
    parser.add_argument("--width", type=int, default=1024, help="K = N")
    args = parser.parse_args()
    print(support_table())
    print()
    print(table([int(t) for t in args.tokens.split(",")], args.width))


if __name__ == "__main__":
    main()
