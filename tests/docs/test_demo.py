"""`mixprec demo`: the three runs tell the story (underflow without scaling, the scaled run tracks
float32, an injected overflow is skipped and backed off), the figure is a real PNG, the JSON
parses, and bad options exit non-zero with a message instead of a traceback."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from mixprec.cli import main
from mixprec.cli._progress import Progress

STEPS, INJECT = 40, 20


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("demo")
    argv = ["demo", "--steps", str(STEPS), "--inject-inf", str(INJECT), "--json"]
    code, stdout, stderr = _run([*argv, "--no-progress", "--out", str(out)])
    assert code == 0, stderr
    doc: dict[str, Any] = json.loads(stdout)
    return doc


def _runs(doc: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    fp32, low, scaled = doc["runs"]
    assert (fp32["dtype"], low["dtype"], scaled["dtype"]) == ("float32", "float16", "float16")
    assert (low["scaled"], scaled["scaled"]) == (False, True)
    return fp32, low, scaled


def test_json_describes_the_three_runs(demo: dict[str, Any]) -> None:
    assert demo["config"]["steps"] == STEPS and demo["config"]["inject_inf"] == INJECT
    for run in demo["runs"]:
        assert len(run["losses"]) == STEPS
        assert all(v > 0 and v == v for v in run["losses"])  # positive, no NaN
        assert run["wall_s"] > 0


def test_fp16_without_scaling_loses_gradient_and_scaler_tracks_fp32(demo: dict[str, Any]) -> None:
    fp32, low, scaled = _runs(demo)
    assert fp32["flushed_fraction"] is None
    assert low["flushed_fraction"] > 0.05, "fp16 without scaling should flush small grads"
    assert scaled["flushed_fraction"] < 0.01 * low["flushed_fraction"] + 1e-9
    gap_low = abs(low["test_loss"] - fp32["test_loss"]) / fp32["test_loss"]
    gap_scaled = abs(scaled["test_loss"] - fp32["test_loss"]) / fp32["test_loss"]
    assert gap_scaled < 0.01, f"scaled run is {gap_scaled:.2%} away from fp32"
    assert gap_scaled < 0.2 * gap_low
    assert scaled["r2"] > low["r2"]


def test_injected_overflow_is_skipped_and_backed_off(demo: dict[str, Any]) -> None:
    _, low, scaled = _runs(demo)
    assert INJECT in scaled["skipped_steps"]
    assert scaled["steps_skipped"] == len(scaled["skipped_steps"]) >= 1
    scales = scaled["scales"]  # scale used at each step
    assert len(scales) == STEPS
    assert scales[INJECT + 1] == scales[INJECT] * 0.5
    assert scaled["injected_inf_at"] == INJECT and low["injected_inf_at"] is None


def _share_below(hist: dict[str, Any], log2_limit: int) -> float:
    counts = [a + b for a, b in zip(hist["outputs"], hist["weights"], strict=True)]
    below = sum(c for k, c in enumerate(counts, hist["log2_low"]) if k < log2_limit)
    return below / sum(counts)


def test_json_holds_the_cause_gradients_below_fp16_and_lifted_by_the_scale(
    demo: dict[str, Any],
) -> None:
    fp32, low, scaled = _runs(demo)
    assert fp32["gradients"] is None
    h_low, h_scaled = low["gradients"], scaled["gradients"]
    assert (h_low["scaled"], h_scaled["scaled"]) == (False, True)
    sizes = [sum(h["outputs"]) + sum(h["weights"]) + h["zeros"] for h in (h_low, h_scaled)]
    assert sizes[0] == sizes[1] > 0  # the same tensors were histogrammed in both runs
    assert _share_below(h_low, -24) > 0.3  # below fp16's smallest subnormal, 2^-24
    assert _share_below(h_scaled, -24) < 0.01  # the scale lifted them into range
    assert low["probe_steps"] == scaled["probe_steps"] and len(low["probe_steps"]) == 30
    assert len(low["flushed_by_probe"]) == 30
    assert sum(low["flushed_by_probe"]) / 30 > 0.05 and max(scaled["flushed_by_probe"]) < 0.001


def test_figure_is_a_valid_png(demo: dict[str, Any]) -> None:
    path = Path(demo["figure"])
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000
    import matplotlib.image

    image = matplotlib.image.imread(path)
    assert image.shape[0] >= 400 and image.shape[1] >= 600
    assert float(image[..., :3].std()) > 0.01  # not a blank canvas


def test_table_and_bfloat16() -> None:
    code, out, err = _run(
        ["demo", "--steps", "8", "--dtype", "bfloat16", "--no-progress", "--no-plot"]
    )
    assert code == 0, err
    assert "run" in out and "grads flushed" in out and "bf16 + GradScaler" in out
    assert "exponent range" in out and "Figure:" not in out


BAD_OPTIONS = {
    "steps zero": (["--steps", "0"], "--steps"),
    "steps not int": (["--steps", "ten"], "--steps"),
    "dtype": (["--dtype", "int8"], "float16 or bfloat16"),
    "device name": (["--device", "gpu0"], "not a device"),
    "device without data": (["--device", "meta"], "cannot be used"),
    "inject after end": (["--steps", "5", "--inject-inf", "5"], "0..4"),
    "inject negative": (["--inject-inf", "-1"], "--inject-inf"),
    "seed": (["--seed", "x"], "--seed"),
    "unknown option": (["--bogus"], "unrecognized"),
}


@pytest.mark.parametrize("argv, expected", BAD_OPTIONS.values(), ids=BAD_OPTIONS.keys())
def test_bad_options_exit_nonzero_with_a_message(argv: list[str], expected: str) -> None:
    code, out, err = _run(["demo", *argv])
    assert code != 0
    assert "error" in err and expected in err
    assert "Traceback" not in err + out


def test_out_that_is_a_file_is_rejected(tmp_path: Path) -> None:
    target = tmp_path / "taken"
    target.write_text("")
    code, _, err = _run(["demo", "--out", str(target)])
    assert code != 0 and "not a folder" in err


def test_out_that_cannot_be_created_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    code, _, err = _run(["demo", "--out", str(tmp_path / "file" / "sub")])
    assert code != 0 and "cannot be created" in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message when CUDA is absent")
def test_unavailable_cuda_is_a_clear_error() -> None:
    code, _, err = _run(["demo", "--device", "cuda"])
    assert code != 0 and "no cuda device is available" in err


def test_no_command_and_help() -> None:
    code, _, err = _run([])
    assert code == 2 and "choose a command" in err
    code, out, _ = _run(["demo", "--help"])
    assert code == 0 and "--inject-inf" in out


def test_progress_falls_back_to_plain_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
    stream = io.StringIO()
    with Progress(8, "run", stream=stream) as bar:
        for _ in range(8):
            bar.update()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "run: training 8 steps"
    assert lines[1:] == ["run: 2/8 (25%)", "run: 4/8 (50%)", "run: 6/8 (75%)", "run: 8/8 (100%)"]


def test_progress_uses_tqdm_when_installed() -> None:
    pytest.importorskip("tqdm", reason="the [progress] extra is not installed")
    stream = io.StringIO()
    with Progress(4, "run", stream=stream) as bar:
        for _ in range(4):
            bar.update()
    assert "4/4" in stream.getvalue() and "it/s" in stream.getvalue()


def test_scaled_run_matches_torch_amp_bit_for_bit() -> None:
    """The demo's scaled run is what torch.optim.Adam with torch.amp.GradScaler would do: same
    losses, same scales (the demo steps Adam without its compile wrappers: same numbers)."""
    from mixprec.cli import _task

    steps, inject = 40, 7
    task = _task.make_task(3, steps, torch.device("cpu"))
    spec = _task.RunSpec("scaled", autocast=True, scaled=True)
    ours = _task.train(task, spec, torch.float16, inject_inf=inject)

    model = copy.deepcopy(task.model)
    opt = torch.optim.Adam(model.parameters(), lr=_task.LR)
    scaler = torch.amp.GradScaler("cpu", growth_interval=_task.GROWTH_INTERVAL)
    losses, scales = [], []
    for step, idx in enumerate(task.batches()):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(task.x[idx]).float(), task.y[idx])
        scales.append(scaler.get_scale())
        scaler.scale(loss).backward()
        if step == inject:
            next(iter(model.parameters())).grad.view(-1)[0] = math.inf
        scaler.step(opt)
        scaler.update()
        losses.append(float(loss.detach()))
    assert ours.losses == losses
    assert ours.scales == scales
    assert ours.final_scale == scaler.get_scale()
    assert ours.skipped_steps == [inject]


def test_without_matplotlib_the_demo_still_runs_and_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises
    argv = ["demo", "--steps", "2", "--json", "--no-progress", "--out", str(tmp_path)]
    code, out, err = _run(argv)
    assert code == 0, err
    assert json.loads(out)["figure"] is None
    assert "mixprec[plot]" in err
    assert not (tmp_path / "mixprec-demo.png").exists()
