"""Tables people can read and a summary that counts matmuls (issue 40, items 2 and 3).

- The default table's lines are at most 100 characters for any candidates, with or without a
  GPU, on models with long (Hugging Face style) module names; ``wide=True`` has every figure.
- One name per quantity: each SQNR column of the wide table is the JSON field of that figure
  (``model-grad`` is ``model_grad_sqnr``), the per-matmul columns are the matmuls' names, and no
  two columns differ only by punctuation; every abbreviated column is explained in the legend.
- The matmul counts are checked against the policy itself: each measured Linear's rule, read
  back through ``Policy.module_rule``, gives its three matmuls' formats; the summary line says
  how many run in 16-bit and what "kept" means.
- ``Fp8Stats.summary()`` shows only the operands that were cast and wraps long names.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec._src.advisor.report.table import WIDTH
from mixprec._src.autocast.rules import Rule, format_dtype
from mixprec._src.fp8.recipes import MATMULS


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attention_projection_in = nn.Linear(d, d)
        self.attention_projection_out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attention_projection_out(torch.tanh(self.attention_projection_in(x)))


class Net(nn.Module):
    """Names as long as Hugging Face's (``transformer.h.0.attention_projection_out``)."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.h = nn.ModuleList(Block(d) for _ in range(2))
        self.lm_head = nn.Linear(d, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(x)


def _advise(candidates: list[str], **kwargs: Any) -> mixprec.types.Advice:
    torch.manual_seed(0)
    model = Net()
    batch = (torch.randn(64, 64), torch.randn(64, 32))

    def loss_fn(m: nn.Module, b: Any) -> torch.Tensor:
        return F.mse_loss(m(b[0]).float(), b[1])

    return mixprec.advise(model, batch, loss_fn, candidates=candidates, **kwargs)


CASES = [
    (["fp16"], {}),
    (["bf16", "fp16"], {"keep_at_most": 1}),
    (["nvfp4", "fp8", "mxfp8"], {"min_sqnr": 25.0}),
    (["nvfp4", "fp8", "mxfp8", "fp8:rowwise"], {"min_sqnr": 25.0, "gpu": "b200"}),
    (["fp8", "bf16"], {"gpu": "h100", "per_matmul": False, "min_sqnr": 40.0}),
]


@pytest.fixture(scope="module", params=range(len(CASES)))
def advice(request: pytest.FixtureRequest) -> mixprec.types.Advice:
    candidates, kwargs = CASES[request.param]
    return _advise(candidates, **kwargs)


def test_the_default_table_fits_100_columns_and_the_wide_one_has_every_figure(
    advice: mixprec.types.Advice,
) -> None:
    narrow, wide = advice.table(), advice.table(wide=True)
    assert max(len(line) for line in narrow.splitlines()) <= WIDTH
    for name in ("model-grad", "output", "input-grad", "weight-grad", "why"):
        assert re.search(rf"\b{name}\b", _header(wide)), name
    for m in advice.modules:  # every name and reason is in both, wrapped or not
        for text in (m.name, m.reason):
            assert _squash(text) in _squash(narrow) and _squash(text) in _squash(wide)


def _header(table: str) -> str:
    return next(line for line in table.splitlines() if line.startswith("module"))


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def test_one_name_per_quantity_in_the_table_the_json_and_the_legend(
    advice: mixprec.types.Advice,
) -> None:
    wide = advice.table(wide=True)
    columns = set(_header(wide).split())
    fields = json.loads(advice.to_json())["modules"][0]["measurements"][0]
    sqnr = {c for c in columns if c.replace("-", "_") + "_sqnr" in fields}
    assert sqnr == {"model-grad", "output", "input-grad", "weight-grad"}
    keys = {re.sub(r"[^a-z0-9]", "", c) for c in columns}
    assert len(keys) == len(columns)  # no two columns differ by punctuation only
    for line in wide.splitlines():  # the per-matmul table: its columns are the matmuls
        if line.startswith("module") and "fprop" in line:
            assert set(line.split()[1:-1]) == set(MATMULS)
    legend = wide[wide.index("model-grad:") :]
    for column in columns - {"module", "type", "params", "decision", "why", *advice.candidates}:
        assert f"{column}:" in legend or f"({column})" in legend or column in legend, column


def test_the_matmul_counts_are_the_policys(advice: mixprec.types.Advice) -> None:
    """Each measured Linear's rule, read back from the policy, gives its matmuls' formats."""
    model = Net()
    modules = dict(model.named_modules())
    expected: dict[str, int] = {}
    region = format_dtype(advice.dtype)
    for row in advice.modules:
        rule = advice.policy.module_rule(modules[row.name], row.name)
        word = region if rule is None else str(rule)
        matmuls = Rule(word).matmuls or (word,) * 3
        input_grad = row.gemms is not None and any(row.gemms.input_grad)
        for name, fmt in zip(MATMULS, matmuls, strict=True):
            if name != "dgrad" or input_grad:
                expected[fmt] = expected.get(fmt, 0) + 1
    assert advice.matmuls == expected
    assert json.loads(advice.to_json())["matmuls"] == expected
    total = sum(expected.values())
    sixteen = sum(n for w, n in expected.items() if w in ("fp16", "bf16"))
    table = advice.table()
    assert f"{sixteen} of {total} in 16-bit" in _squash_spaces(table)
    start = re.search(r"^kept: ", table, re.MULTILINE)
    assert start is not None
    kept_line = _squash_spaces(table[start.start() :])
    assert f"kept: out of every candidate, all its matmuls in {advice.kept_precision}" in kept_line
    count = len(advice.kept)
    assert kept_line.startswith(f"kept: {count} module" if count else "kept: no module")


def _squash_spaces(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_the_plot_names_the_matmul_counts(advice: mixprec.types.Advice) -> None:
    pytest.importorskip("matplotlib", reason="the plot needs the [plot] extra")
    fig = advice.plot()
    title = fig._suptitle.get_text()
    total = sum(advice.matmuls.values())
    assert f"matmuls: {total} (the measured modules'" in title and "in 16-bit" in title


def test_fp8_stats_summary_shows_only_what_was_cast_and_wraps_long_names() -> None:
    torch.manual_seed(0)
    model = Net()
    policy = "transformer.h.*.attention_projection_in=fp8/bf16/bf16, nn.Linear=fp8"
    stats = mixprec.Fp8Stats()
    with stats, mixprec.autocast("cpu", torch.bfloat16, policy=policy):
        loss = model(torch.randn(16, 64, requires_grad=True)).float().square().mean()
    loss.backward()
    text = stats.summary()
    table = [ln for ln in text.splitlines()[1:] if re.search(r"\b(input|weight|grad_output)\b", ln)]
    read = stats.read()
    cast = sum(
        1
        for s in read.values()
        for op in ("input", "weight", "grad_output")
        if getattr(s, op).elements
    )
    assert len(table) == cast  # no row of zeros for an operand a per-matmul rule never cast
    assert cast < 3 * len(read)
    lines = text.splitlines()
    width = lines[0].index("recipe")
    rows = [ln for ln in lines[1 : 1 + len(table) + 8] if not ln.startswith("at-max:")]
    joined = "".join(ln[:width].strip() for ln in rows if ln[:width].strip())
    for name in read:
        assert name in joined  # each name, wrapped at its dots, reads back
    assert width <= 25
    assert "at-max" in text.splitlines()[0] and "at-max:" in text
