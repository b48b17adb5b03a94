"""Checkpoints: resume in a fresh process bit-identically, both ways with torch.amp.GradScaler.

The parent process trains for ``SAVE_AT`` iterations and saves (model, optimizer, scaler) with
``torch.save``; a fresh Python process loads them with ``torch.load(weights_only=True)``, builds a
new scaler, loads its state *before the first forward* and trains to the end. The result must be
bit-identical to a run that was never interrupted: the scale after every iteration, the skipped
steps, the parameters. Overflows are injected before and after the checkpoint so that the
trajectory has backoffs and growths on both sides.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import mixprec
from mixprec.errors import ScalerStateError

# Every test runs on the CPU's path and on the path a CUDA user takes (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("scaler_path")

ITERATIONS = 10
SAVE_AT = 5
OVERFLOW_AT = (2, 7)
SETTINGS = {"init_scale": 2.0**12, "growth_interval": 2}


def make_scaler(kind: str) -> Any:
    if kind == "torch":
        return torch.amp.GradScaler("cpu", **SETTINGS)
    return mixprec.GradScaler(**SETTINGS)


def make_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def batch(iteration: int) -> torch.Tensor:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(100 + iteration))
    if iteration in OVERFLOW_AT:
        x[0, 0] = 1e6  # the fp16 forward overflows
    return x


def train(
    model: nn.Module, opt: torch.optim.Optimizer, scaler: Any, start: int, stop: int
) -> list[float]:
    scales = []
    for it in range(start, stop):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(batch(it)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        scales.append(scaler.get_scale())
    return scales


def save(path: Path, kind: str) -> list[float]:
    model, opt = make_model()
    scaler = make_scaler(kind)
    scales = train(model, opt, scaler, 0, SAVE_AT)
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()}
    torch.save(state, path)
    return scales


def resume(path: Path, kind: str) -> dict[str, Any]:
    """What the fresh process runs: load before the first forward, then train to the end."""
    state = torch.load(path, weights_only=True)
    model, opt = make_model()
    scaler = make_scaler(kind)
    scaler.load_state_dict(state["scaler"])
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    scales = train(model, opt, scaler, SAVE_AT, ITERATIONS)
    params = [p.detach().flatten().tolist() for p in model.parameters()]
    return {"scales": scales, "params": params}


def _child(directory: str, path: str = "host") -> None:
    torch.set_num_threads(1)
    if path == "device":
        from tests.scaler_paths import device_path

        with device_path():
            return _resume_all(directory)
    _resume_all(directory)


def _resume_all(directory: str) -> None:
    out = {}
    for name in os.listdir(directory):
        if name.endswith(".pt"):
            resumed_by = name[:-3].split("-")[1]
            out[name] = resume(Path(directory, name), resumed_by)
    Path(directory, "result.json").write_text(json.dumps(out))


def uninterrupted(kind: str) -> dict[str, Any]:
    model, opt = make_model()
    scales = train(model, opt, make_scaler(kind), 0, ITERATIONS)
    return {"scales": scales, "params": [p.detach().flatten().tolist() for p in model.parameters()]}


def test_resume_in_a_fresh_process_is_bit_identical(tmp_path: Path, scaler_path: str) -> None:
    pairs = [("mixprec", "mixprec"), ("torch", "mixprec"), ("mixprec", "torch")]
    first_half = {}
    for saved_by, resumed_by in pairs:
        first_half[saved_by, resumed_by] = save(tmp_path / f"{saved_by}-{resumed_by}.pt", saved_by)
    here = Path(__file__).resolve().parent
    code = (
        f"import sys; sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]; "
        "import test_checkpoint as t; t._child(sys.argv[1], sys.argv[2])"
    )
    command = [sys.executable, "-c", code, str(tmp_path), scaler_path]
    subprocess.run(command, check=True, timeout=120)
    results = json.loads((tmp_path / "result.json").read_text())

    reference = {kind: uninterrupted(kind) for kind in ("mixprec", "torch")}
    # Default settings: mixprec's uninterrupted trajectory is torch's, bit for bit.
    assert reference["mixprec"] == reference["torch"]
    scales = reference["mixprec"]["scales"]
    assert scales[OVERFLOW_AT[0]] < scales[OVERFLOW_AT[0] - 1]  # a backoff before the save
    assert scales[OVERFLOW_AT[1]] < scales[OVERFLOW_AT[1] - 1]  # and one after it
    assert max(scales) > SETTINGS["init_scale"]  # and growth
    for (saved_by, resumed_by), head in first_half.items():
        got = results[f"{saved_by}-{resumed_by}.pt"]
        assert head + got["scales"] == scales, (saved_by, resumed_by)
        assert got["params"] == reference["mixprec"]["params"], (saved_by, resumed_by)


def _trained_scaler(**kwargs: Any) -> tuple[mixprec.GradScaler, nn.Module, torch.optim.Optimizer]:
    model, opt = make_model()
    scaler = mixprec.GradScaler(**{**SETTINGS, **kwargs})
    train(model, opt, scaler, 0, 4)
    return scaler, model, opt


def test_state_dict_survives_torch_save_with_weights_only() -> None:
    scaler, _, _ = _trained_scaler(min_scale=1.0, hysteresis=2)
    state = scaler.state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded == state
    fresh = mixprec.GradScaler()
    fresh.load_state_dict(loaded)
    assert fresh.state_dict() == state
    assert fresh.stats() == scaler.stats()
    assert fresh.config == dataclasses.replace(scaler.config, init_scale=fresh.config.init_scale)


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_copies_at_iteration_boundaries_continue_identically(how: str) -> None:
    def clone(obj: Any) -> Any:
        return pickle.loads(pickle.dumps(obj)) if how == "pickle" else copy.deepcopy(obj)

    never_scaled = clone(mixprec.GradScaler(**SETTINGS))
    assert never_scaled.state_dict() == mixprec.GradScaler(**SETTINGS).state_dict()

    scaler, model, opt = _trained_scaler(history=8)
    twin, twin_model, twin_opt = clone((scaler, model, opt))
    assert twin.state_dict() == scaler.state_dict()
    assert twin.history() == scaler.history()
    assert train(model, opt, scaler, 4, ITERATIONS) == train(
        twin_model, twin_opt, twin, 4, ITERATIONS
    )
    assert twin.stats() == scaler.stats()
    assert twin.history() == scaler.history()
    for p, q in zip(model.parameters(), twin_model.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
@pytest.mark.parametrize("where", ["after unscale_", "after step"])
def test_copy_mid_iteration_is_a_clear_error_and_harmless(how: str, where: str) -> None:
    scaler, model, opt = _trained_scaler()
    before = scaler.state_dict()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(batch(4)).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.unscale_(opt) if where == "after unscale_" else scaler.step(opt)
    copier = pickle.dumps if how == "pickle" else copy.deepcopy
    with pytest.raises(ScalerStateError, match=r"mid-iteration.*Call scaler\.update\(\) first"):
        copier(scaler)
    if where == "after unscale_":
        scaler.step(opt)
    scaler.update()  # the iteration completes as if nothing had happened
    assert scaler.stats().iterations == 5
    assert scaler.state_dict()["_growth_tracker"] == (before["_growth_tracker"] + 1) % 2
    copier(scaler)  # and copying works again at the boundary


def test_hooks_are_not_copied_and_say_so() -> None:
    scaler, _, _ = _trained_scaler()
    scaler.register_update_hook(lambda s, e: None)
    twin = pickle.loads(pickle.dumps(scaler))
    assert len(scaler._telemetry.hooks) == 1 and len(twin._telemetry.hooks) == 0


@pytest.mark.parametrize("order", ["init, load", "load, init", "load, load"])
def test_load_in_any_order_with_the_lazy_init_hook(order: str) -> None:
    """accelerate#4289: torch asserts '_growth_tracker initialized before _scale' there."""
    source, _, _ = _trained_scaler()
    state = source.state_dict()
    scaler = mixprec.GradScaler()
    for action in order.split(", "):
        if action == "init":
            scaler._lazy_init_scale_growth_tracker("cpu")
        else:
            scaler.load_state_dict(state)
    scaler._lazy_init_scale_growth_tracker("cpu")
    assert scaler.state_dict() == state
    assert scaler.stats() == source.stats()
    assert torch.equal(scaler.scale(torch.ones(())), torch.tensor(state["scale"]))


def test_resume_mid_overflow_streak_with_hysteresis_and_bounds() -> None:
    """mixprec's own state (streak, counters, bounds) rides the state dict: resume is exact."""
    settings = {"hysteresis": 2, "min_scale": 2.0**6, "max_scale": 2.0**14}

    def run(stop: int, scaler: Any, model: nn.Module, opt: Any, start: int = 0) -> list[float]:
        scales = []
        for it in range(start, stop):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(100 + it))
            if it in (3, 4, 5, 8, 9):  # a streak of 3 split by the checkpoint at 4
                x[0, 0] = 1e6
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            scales.append(scaler.get_scale())
        return scales

    model, opt = make_model()
    full = run(12, mixprec.GradScaler(**SETTINGS, **settings), model, opt)
    model, opt = make_model()
    scaler = mixprec.GradScaler(**SETTINGS, **settings)
    head = run(4, scaler, model, opt)
    saved = copy.deepcopy((scaler.state_dict(), model.state_dict(), opt.state_dict()))
    assert saved[0]["_overflow_streak"] == 1
    model, opt = make_model()
    resumed = mixprec.GradScaler()  # settings come from the state dict
    resumed.load_state_dict(saved[0])
    model.load_state_dict(saved[1])
    opt.load_state_dict(saved[2])
    assert head + run(12, resumed, model, opt, start=4) == full
    assert min(full) >= 2.0**6 and full[4] == full[3] / 2  # the streak's 2nd overflow backs off
