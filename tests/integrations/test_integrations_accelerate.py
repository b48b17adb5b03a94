"""accelerate 1.15 on the CPU with mixed_precision="fp16" and mixprec's scaler.

The oracle is the same loop written by hand with ``torch.autocast("cpu", float16)`` and
``torch.amp.GradScaler("cpu")``: parameters, skipped steps and scaler state must match exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import mixprec
from mixprec.errors import ConfigError, ScalerStateError

accelerate = pytest.importorskip("accelerate", reason="needs the [accelerate] extra")
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import GradScalerKwargs  # noqa: E402

from mixprec.integrations.accelerate import use_mixprec_scaler  # noqa: E402

TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
OVERFLOW_AT = (0, 3, 6)  # iterations whose input overflows fp16 (0: a skipped first step)


@pytest.fixture(autouse=True)
def fresh_state() -> Iterator[None]:
    """accelerate keeps process-wide singletons; each test starts from a clean one."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def make(fused: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused, foreach=None)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)


def batches(start: int, stop: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    for i in range(start, stop):
        gen = torch.Generator().manual_seed(i)
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)
        yield i, (x * 1e5 if i in OVERFLOW_AT else x), y


def train_accelerate(acc: Any, model: Any, opt: Any, sched: Any, start: int, stop: int) -> Any:
    reported, truth = [], []
    for _, x, y in batches(start, stop):
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        reported.append(opt.step_was_skipped)
        truth.append(acc.scaler.last_step_skipped())
    return reported, truth


def train_torch(fused: bool, stop: int) -> tuple[torch.nn.Module, Any, list[bool]]:
    model, opt, sched = make(fused)
    scaler = torch.amp.GradScaler("cpu")
    skipped = []
    for _, x, y in batches(0, stop):
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < before)
        if not skipped[-1]:
            sched.step()
        opt.zero_grad()
    return model, scaler, skipped


def prepared(fused: bool, **acc_kwargs: Any) -> tuple[Any, Any, Any, Any]:
    acc = accelerate.Accelerator(mixed_precision="fp16", cpu=True, **acc_kwargs)
    use_mixprec_scaler(acc)
    model, opt, sched = acc.prepare(*make(fused))
    return acc, model, opt, sched


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_matches_hand_written_torch_loop(fused: bool) -> None:
    acc, model, opt, sched = prepared(fused)
    seen: list[torch.dtype] = []
    model[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    reported, truth = train_accelerate(acc, model, opt, sched, 0, 8)
    ref_model, ref_scaler, ref_skipped = train_torch(fused, 8)

    assert set(seen) == {torch.float16}  # autocast is on although the device is the CPU
    assert truth == ref_skipped and all(truth[i] for i in OVERFLOW_AT)
    assert reported == truth  # accelerate's skip flag, fused optimizers included
    for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    state, ref_state = acc.scaler.state_dict(), ref_scaler.state_dict()
    assert {k: state[k] for k in TORCH_KEYS} == {k: ref_state[k] for k in TORCH_KEYS}
    # AcceleratedScheduler steps only on real updates.
    assert sched.scheduler.last_epoch == truth.count(False)


def test_bare_assignment_misreports_fused_skips() -> None:
    """Why the helper exists: with a fused optimizer accelerate's own flag misses skips."""
    acc = accelerate.Accelerator(mixed_precision="fp16", cpu=True)
    acc.scaler, acc.native_amp = mixprec.GradScaler(), True
    model, opt, sched = acc.prepare(*make(fused=True))
    reported, truth = train_accelerate(acc, model, opt, sched, 0, 8)
    assert truth[3] and not reported[3]  # the fused kernel skipped, its step() was called
    assert truth[0] and reported[0]  # a skipped first step: mixprec does not call step()


def test_save_and_load_state_resume_identically(tmp_path: Path) -> None:
    acc, model, opt, sched = prepared(fused=False)
    train_accelerate(acc, model, opt, sched, 0, 5)
    acc.save_state(str(tmp_path))
    saved = acc.scaler.state_dict()
    assert torch.load(tmp_path / "scaler.pt", weights_only=False) == saved
    train_accelerate(acc, model, opt, sched, 5, 8)

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc2, model2, opt2, sched2 = prepared(fused=False)
    acc2.load_state(str(tmp_path))
    assert acc2.scaler.state_dict() == saved
    train_accelerate(acc2, model2, opt2, sched2, 5, 8)
    assert acc2.scaler.state_dict() == acc.scaler.state_dict()
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_helper_takes_grad_scaler_kwargs_that_accelerate_ignores_on_cpu() -> None:
    handler = GradScalerKwargs(init_scale=1024.0, growth_interval=7)
    acc = accelerate.Accelerator(mixed_precision="fp16", cpu=True, kwargs_handlers=[handler])
    scaler = use_mixprec_scaler(acc)
    assert (scaler.get_scale(), scaler.get_growth_interval()) == (1024.0, 7)


def test_helper_refuses_misuse() -> None:
    acc = accelerate.Accelerator(mixed_precision="fp16", cpu=True)
    acc.prepare(make(fused=False)[1])
    with pytest.raises(ScalerStateError, match=r"before accelerator\.prepare"):
        use_mixprec_scaler(acc)
    AcceleratorState._reset_state(True)
    with pytest.raises(ConfigError, match="bf16 needs no loss scaling"):
        use_mixprec_scaler(accelerate.Accelerator(mixed_precision="bf16", cpu=True))


def test_fsdp1_needs_a_scaler_with_a_process_group() -> None:
    import socket

    import torch.distributed as dist
    from accelerate.utils import DistributedType

    acc = accelerate.Accelerator(mixed_precision="fp16", cpu=True)
    acc.state.distributed_type = DistributedType.FSDP  # what an FSDP1 launch sets
    with pytest.raises(ConfigError, match=r"process_group=torch\.distributed\.group\.WORLD"):
        use_mixprec_scaler(acc)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        scaler = mixprec.GradScaler(process_group=dist.group.WORLD)
        assert use_mixprec_scaler(acc, scaler) is scaler
    finally:
        dist.destroy_process_group()
