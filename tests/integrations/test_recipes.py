"""Recipes for the trainers people use, run with the real packages (pinned in constraints.txt).

* Lightning, with both ``lightning`` and ``pytorch-lightning`` installed: ``MixprecPrecision``
  builds the plugin of the package the program imported, whatever the import order; with both
  imported it says which class to use.
* timm: docs/timm.md's block runs against timm's own ``NativeScaler``, loaded without
  torchvision (which cannot be imported beside the CPU build of torch), bit-identical to the
  stock ``NativeScaler`` with torch's scaler.

The 🤗 transformers ``Trainer`` recipe is docs/transformers.md, run by
tests/docs/test_doc_snippets.py.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.forked_runner import python_blocks

ROOT = Path(__file__).resolve().parents[2]

LIGHTNING_SCRIPT = """
import warnings
warnings.filterwarnings("ignore")
import torch
from mixprec.errors import ConfigError
from mixprec.integrations.lightning import MixprecPrecision, plugin_class  # before Lightning

import {first} as pl

plugin = MixprecPrecision("16-mixed", "cpu")
assert isinstance(plugin, pl.plugins.MixedPrecision), type(plugin).__mro__
assert isinstance(plugin, MixprecPrecision)
trainer = pl.Trainer(accelerator="cpu", plugins=[plugin], max_steps=1, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False)
assert trainer.precision_plugin is plugin

import {second} as other

try:
    MixprecPrecision("16-mixed", "cpu")
except ConfigError as exc:
    assert "plugin_class('pytorch_lightning')" in str(exc), exc
    assert "plugin_class('lightning.pytorch')" in str(exc), exc
else:
    raise AssertionError("both packages imported: expected a ConfigError")
named = plugin_class("{second}")("16-mixed", "cpu")
other.Trainer(accelerator="cpu", plugins=[named], logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False)
assert isinstance(named, MixprecPrecision) and not isinstance(named, pl.plugins.MixedPrecision)
print("ok")
"""


def test_lightning_plugin_follows_the_package_imported() -> None:
    """The order that used to fail: MixprecPrecision imported before pytorch_lightning (it then
    built the lightning.pytorch class, which pytorch_lightning's Trainer refuses)."""
    first, second = "pytorch_lightning", "lightning.pytorch"
    for package in (first, second):
        pytest.importorskip(package.split(".")[0], reason="needs lightning and pytorch-lightning")
    script = LIGHTNING_SCRIPT.format(first=first, second=second)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=180, env=env
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def _timm_scaler_module(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """timm's ``timm/utils/cuda.py`` (``NativeScaler``) and what it imports (``clip_grad.py``,
    ``agc.py``), loaded from the installed timm without running ``timm/__init__.py`` (which
    imports torchvision). Registered as ``timm.utils`` for the duration of the test."""
    spec = importlib.util.find_spec("timm")
    if spec is None or spec.origin is None:
        pytest.skip("timm is not installed (make test installs the version in constraints.txt)")
    root = Path(spec.origin).parent
    for name, folder in (("timm", root), ("timm.utils", root / "utils")):
        package = types.ModuleType(name)
        package.__path__ = [str(folder)]
        monkeypatch.setitem(sys.modules, name, package)
    cuda = importlib.import_module("timm.utils.cuda")
    sys.modules["timm.utils"].NativeScaler = cuda.NativeScaler  # type: ignore[attr-defined]
    return cuda


def _doc_block(page: str, index: int) -> str:
    return python_blocks((ROOT / "docs" / page).read_text(encoding="utf-8"))[index][1]


def test_timm_recipe_runs_and_matches_the_stock_native_scaler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cuda = _timm_scaler_module(monkeypatch)
    assert "_scaler" in vars(cuda.NativeScaler(device="cpu"))  # the attribute the swap sets
    block = _doc_block("timm.md", 0)
    assert "loss_scaler._scaler = mixprec.GradScaler(device.type)" in block

    def run(code: str) -> dict[str, Any]:
        torch.manual_seed(0)
        namespace: dict[str, Any] = {}
        exec(compile(code, "docs/timm.md", "exec"), namespace)
        return namespace

    ours = run(block)
    stock_block = block.replace("loss_scaler._scaler = mixprec.GradScaler(device.type)", "")
    stock = run(stock_block.replace("loss_scaler._scaler.stats()", "None"))
    scaler = ours["loss_scaler"]._scaler
    assert type(scaler).__module__.startswith("mixprec")
    assert type(stock["loss_scaler"]._scaler) is torch.amp.GradScaler
    stats = scaler.stats()
    assert stats.iterations == 6 and stats.steps_skipped == 1
    for a, b in zip(ours["model"].parameters(), stock["model"].parameters(), strict=True):
        assert torch.equal(a, b)
    saved, torch_saved = ours["checkpoint"]["amp_scaler"], stock["loss_scaler"].state_dict()
    assert {k: saved[k] for k in torch_saved} == torch_saved  # torch's keys, torch's values
    fresh = cuda.NativeScaler(device="cpu")
    fresh.load_state_dict(ours["checkpoint"]["amp_scaler"])  # timm's own scaler resumes it
    assert fresh._scaler.get_scale() == scaler.get_scale()


def test_timm_cannot_be_imported_here_without_torchvision() -> None:
    """The reason docs/timm.md's block is not run by test_doc_snippets: if this starts failing (timm
    imports without torchvision, or a CPU torchvision installs), run the block there instead."""
    if importlib.util.find_spec("timm") is None:
        pytest.skip("timm is not installed (make test installs the version in constraints.txt)")
    before = set(sys.modules)
    try:
        with pytest.raises((ImportError, RuntimeError), match="torchvision"):
            importlib.import_module("timm")
    finally:
        for name in set(sys.modules) - before:  # drop the half-imported timm modules
            del sys.modules[name]
