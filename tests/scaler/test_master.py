"""MasterWeights: fp16/bf16 trainable parameters with fp32 masters, against torch and fp32 runs."""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import mixprec
from mixprec.errors import ConfigError, LowPrecisionGradError

torch.manual_seed(0)
X = torch.randn(32, 8)
Y = X[:, :2].sum(1, keepdim=True)


class PeftLike(nn.Module):
    """A frozen fp16 base, an fp32 low-rank adapter and one fp16 trainable head."""

    def __init__(self, head_dtype: torch.dtype = torch.float16) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.base = nn.Linear(8, 16).half().requires_grad_(False)
        self.lora_a = nn.Linear(8, 2, bias=False)
        self.lora_b = nn.Linear(2, 16, bias=False)
        self.head = nn.Linear(16, 1).to(head_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.base(x) + self.lora_b(self.lora_a(x)))
        return self.head(h)


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _loss(model: nn.Module, step: int = 0, inject: set[int] = frozenset()) -> torch.Tensor:  # type: ignore[assignment]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(X).float(), Y)
    return loss * float("inf") if step in inject else loss


def _train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    scaler: Any,
    steps: int,
    inject: set[int] = frozenset(),  # type: ignore[assignment]
) -> list[float]:
    scales = []
    for step in range(steps):
        opt.zero_grad()
        scaler.scale(_loss(model, step, inject)).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def test_torch_refuses_fp16_params_and_mixprec_names_them_and_the_fix() -> None:
    for make_scaler, error, pattern in [
        (lambda: torch.amp.GradScaler("cpu"), ValueError, "Attempting to unscale FP16 gradients"),
        (mixprec.GradScaler, LowPrecisionGradError, r"head\.weight, head\.bias.*MasterWeights"),
    ]:
        model = PeftLike()
        opt = torch.optim.AdamW(_trainable(model), lr=1e-2)
        scaler = make_scaler()
        scaler.scale(_loss(model)).backward()
        with pytest.raises(error, match=pattern):
            scaler.step(opt)


def test_peft_like_model_trains_with_master_weights() -> None:
    model = PeftLike()
    opt = torch.optim.AdamW(_trainable(model), lr=1e-2)
    masters = mixprec.MasterWeights(opt)
    start = _loss(model).item()
    _train(model, opt, mixprec.GradScaler(), steps=30)
    assert _loss(model).item() < 0.5 * start
    assert model.head.weight.dtype == torch.float16 and model.base.weight.dtype == torch.float16
    assert len(masters.pairs) == 2  # head.weight, head.bias: the fp32 adapter is left alone
    for low, master in masters.pairs:
        assert master.dtype == torch.float32
        assert torch.equal(low, master.half())  # refreshed after every step


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
        lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    ],
    ids=["sgd", "adamw-foreach", "adam-fused"],
)
def test_master_weights_match_an_fp32_model_under_the_same_autocast(make_opt: Callable) -> None:
    """Autocast runs the fp32 head in fp16 too (it casts the weight), so the fp32-parameter run
    is the reference: the masters must follow it (they do bit for bit on CPU)."""
    low = PeftLike()
    ref = copy.deepcopy(low)
    ref.head.float()
    low_opt, ref_opt = make_opt(_trainable(low)), make_opt(_trainable(ref))
    masters = mixprec.MasterWeights(low_opt)
    inject = {2, 3}
    low_scales = _train(low, low_opt, mixprec.GradScaler(growth_interval=2), 8, inject)
    ref_scales = _train(ref, ref_opt, mixprec.GradScaler(growth_interval=2), 8, inject)
    assert low_scales == ref_scales
    for (_, master), p in zip(masters.pairs, [ref.head.weight, ref.head.bias], strict=True):
        assert torch.equal(master, p)
    torch.testing.assert_close(low.lora_a.weight, ref.lora_a.weight, rtol=1e-6, atol=1e-7)


def test_master_weights_with_torch_scaler_and_mixprec_scaler_are_bit_identical() -> None:
    runs = []
    for make_scaler in (lambda: torch.amp.GradScaler("cpu", growth_interval=2), mixprec.GradScaler):
        model = PeftLike()
        opt = torch.optim.Adam(_trainable(model), lr=1e-2)
        mixprec.MasterWeights(opt)
        scaler = make_scaler()
        if isinstance(scaler, mixprec.GradScaler):
            scaler.set_growth_interval(2)
        scales = _train(model, opt, scaler, 6, inject={1})
        runs.append((scales, [p.detach().clone() for p in model.parameters()]))
    assert runs[0][0] == runs[1][0]
    for a, b in zip(runs[0][1], runs[1][1], strict=True):
        assert torch.equal(a, b)


def _freed(grad: torch.Tensor | None) -> bool:
    """The low-precision grad holds no memory: a zero placeholder (or nothing)."""
    if grad is None:
        return True
    return grad.untyped_storage().nbytes() <= grad.element_size() and not bool(grad.any())


def test_grads_accumulate_in_fp32_and_low_precision_grads_are_freed() -> None:
    model = PeftLike(head_dtype=torch.bfloat16)
    opt = torch.optim.SGD(_trainable(model), lr=0.1)
    masters = mixprec.MasterWeights(opt)
    grads = []
    for _ in range(2):
        ref = copy.deepcopy(model.head).float()
        out = ref(torch.ones(4, 16)).sum()
        grads.append(torch.autograd.grad(out, ref.weight)[0])
        model.head(torch.ones(4, 16, dtype=torch.bfloat16)).float().sum().backward()
    assert _freed(model.head.weight.grad) and _freed(model.head.bias.grad)
    master_w = masters.pairs[0][1]
    assert master_w.grad is not None and master_w.grad.dtype == torch.float32
    torch.testing.assert_close(master_w.grad, grads[0] + grads[1])
    # a gradient present when the optimizer is converted moves to the master too
    model2 = PeftLike()
    model2.head(torch.ones(4, 16, dtype=torch.float16)).float().sum().backward()
    low_grad = model2.head.weight.grad
    assert low_grad is not None
    opt2 = torch.optim.SGD(_trainable(model2), lr=0.1)
    masters2 = mixprec.MasterWeights(opt2)
    assert _freed(model2.head.weight.grad)
    assert torch.equal(masters2.pairs[0][1].grad, low_grad.float())
    assert masters.overhead_bytes() == (16 + 1) * (8 - 2)
    opt.zero_grad()
    assert master_w.grad is None


def test_state_dict_round_trips_masters_and_optimizer_state() -> None:
    model = PeftLike()
    opt = torch.optim.Adam(_trainable(model), lr=1e-2)
    mixprec.MasterWeights(opt)
    scaler = mixprec.GradScaler()
    _train(model, opt, scaler, 3)
    buffer = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()},
        buffer,
    )
    assert "mixprec_master_weights" in opt.state_dict()
    # continue the original, and a fresh copy loaded from the checkpoint
    _train(model, opt, scaler, 2)
    buffer.seek(0)
    checkpoint = torch.load(buffer)
    model2 = PeftLike()
    opt2 = torch.optim.Adam(_trainable(model2), lr=1e-2)
    masters2 = mixprec.MasterWeights(opt2)
    model2.load_state_dict(checkpoint["model"])
    opt2.load_state_dict(checkpoint["opt"])
    scaler2 = mixprec.GradScaler()
    scaler2.load_state_dict(checkpoint["scaler"])
    _train(model2, opt2, scaler2, 2)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    for (_, m1), (_, m2) in zip(
        opt._mixprec_master_weights.pairs,  # type: ignore[attr-defined]
        masters2.pairs,
        strict=True,
    ):
        assert torch.equal(m1, m2)


def test_a_checkpoint_without_masters_reseeds_them_from_the_model() -> None:
    model = PeftLike()
    opt = torch.optim.SGD(_trainable(model), lr=0.1)
    masters = mixprec.MasterWeights(opt)
    plain = torch.optim.SGD(_trainable(PeftLike()), lr=0.1).state_dict()
    with torch.no_grad():
        model.head.weight.fill_(0.5)
    opt.load_state_dict(plain)
    assert torch.equal(masters.pairs[0][1], torch.full((1, 16), 0.5))


def test_wrapping_twice_or_a_non_optimizer_is_refused() -> None:
    opt = torch.optim.SGD(_trainable(PeftLike()), lr=0.1)
    mixprec.MasterWeights(opt)
    with pytest.raises(ConfigError, match="only once"):
        mixprec.MasterWeights(opt)
    with pytest.raises(ConfigError, match="Optimizer"):
        mixprec.MasterWeights([torch.zeros(1)])  # type: ignore[arg-type]


def _fp16_and_fp32_twins() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(3)
    low = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).half()
    return low, copy.deepcopy(low).float()


def test_lbfgs_closure_sees_the_moved_weights_and_matches_the_fp32_run() -> None:
    """LBFGS moves the masters between closure evaluations: the fp16 model must follow."""
    finals = []
    for model in _fp16_and_fp32_twins():
        opt = torch.optim.LBFGS(model.parameters(), lr=1, max_iter=5)
        if model[0].weight.dtype == torch.float16:
            mixprec.MasterWeights(opt)
        scaler = mixprec.GradScaler()

        def closure(model: nn.Module = model, opt: Any = opt, scaler: Any = scaler) -> Any:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(X).float(), Y)
            scaler.scale(loss).backward()
            return loss

        for _ in range(3):
            scaler.step(opt, closure)
            scaler.update()
        finals.append([p.detach().clone() for g in opt.param_groups for p in g["params"]])
    for master, reference in zip(*finals, strict=True):
        assert torch.equal(master, reference)


def test_sam_with_master_weights_restores_the_fp16_model_after_an_overflow() -> None:
    from test_closure import SAM

    model, _ = _fp16_and_fp32_twins()
    opt = SAM(model.parameters(), torch.optim.SGD, rho=0.05, lr=0.1)
    masters = mixprec.MasterWeights(opt)
    scaler = mixprec.GradScaler(init_scale=2.0**8)  # the fp16 grads of pass 1 must fit

    def loss_fn(factor: float = 1.0) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            return F.mse_loss(model(X).float(), Y) * factor

    seen: list[torch.Tensor] = []

    def closure() -> torch.Tensor:
        seen.append(model[0].weight.detach().clone())  # the model at the perturbed point
        loss = loss_fn(float("inf"))
        scaler.scale(loss).backward()
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(loss_fn()).backward()
    scaler.unscale_(opt)
    assert scaler.step(opt, closure) is None
    assert not torch.equal(seen[0], before[0])  # SAM's perturbation reached the fp16 model
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b)  # and was undone there too
    for low, master in masters.pairs:
        assert torch.equal(low, master.half())


def test_lr_scheduler_works_on_a_converted_optimizer() -> None:
    model = PeftLike()
    opt = torch.optim.SGD(_trainable(model), lr=0.1)
    mixprec.MasterWeights(opt)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _train(model, opt, mixprec.GradScaler(), 2)
    scheduler.step()
    assert opt.param_groups[0]["lr"] == 0.05


def test_copying_or_pickling_a_converted_optimizer_is_refused_with_the_fix() -> None:
    model = PeftLike()
    opt = torch.optim.Adam(_trainable(model), lr=1e-2)
    mixprec.MasterWeights(opt)
    for copy_it in (copy.deepcopy, pickle.dumps, lambda o: torch.save(o, io.BytesIO())):
        with pytest.raises(ConfigError, match=r"optimizer\.state_dict\(\)"):
            copy_it(opt)
    copy.deepcopy(model)  # the model itself copies as usual


def test_master_weights_track_a_pure_fp32_run() -> None:
    """Against fp32 without autocast: fp16 arithmetic differs, so close, not equal."""
    low = PeftLike()
    ref = copy.deepcopy(low).float()
    low_opt = torch.optim.AdamW(_trainable(low), lr=1e-2)
    ref_opt = torch.optim.AdamW(_trainable(ref), lr=1e-2)
    masters = mixprec.MasterWeights(low_opt)
    _train(low, low_opt, mixprec.GradScaler(), 30)
    for _ in range(30):
        ref_opt.zero_grad()
        F.mse_loss(ref(X), Y).backward()
        ref_opt.step()
    for (_, master), p in zip(masters.pairs, [ref.head.weight, ref.head.bias], strict=True):
        torch.testing.assert_close(master, p, rtol=0, atol=2e-2)
    with torch.no_grad():
        assert F.mse_loss(low.float()(X), Y).item() == pytest.approx(
            F.mse_loss(ref(X), Y).item(), rel=0.1
        )


@pytest.mark.parametrize("set_to_none", [True, False])
def test_model_zero_grad_clears_the_masters_like_optimizer_zero_grad(set_to_none: bool) -> None:
    """Zeroing the model (not the optimizer) used to leave the masters accumulating until the
    first inf, after which every step was skipped."""
    runs = []
    for zero in ("optimizer", "model"):
        model = PeftLike()
        opt = torch.optim.AdamW(_trainable(model), lr=1e-2)
        mixprec.MasterWeights(opt)
        scaler = mixprec.GradScaler(growth_interval=2)
        skipped = []
        for step in range(8):
            scaler.scale(_loss(model, step, inject={2})).backward()
            scaler.step(opt)
            scaler.update()
            skipped.append(scaler.last_step_skipped())
            (opt if zero == "optimizer" else model).zero_grad(set_to_none=set_to_none)
        runs.append((skipped, [p.detach().clone() for p in model.parameters()]))
    assert runs[0][0] == runs[1][0]
    assert runs[1][0][2] and not any(runs[1][0][3:])  # the injected inf, and training goes on
    for a, b in zip(runs[0][1], runs[1][1], strict=True):
        assert torch.equal(a, b)


def test_micro_batches_still_accumulate_between_zero_grads() -> None:
    model = PeftLike()
    opt = torch.optim.SGD(_trainable(model), lr=0.1)
    masters = mixprec.MasterWeights(opt)
    master_w = masters.pairs[0][1]
    grads = []
    for _ in range(2):
        model.zero_grad()
        model.head(torch.ones(4, 16, dtype=torch.float16)).float().sum().backward()
        grads.append(master_w.grad.clone())
    model.head(torch.ones(4, 16, dtype=torch.float16)).float().sum().backward()
    torch.testing.assert_close(grads[0], grads[1])  # zeroed in between: the same grad
    torch.testing.assert_close(master_w.grad, 2 * grads[0])  # not zeroed: accumulated
    torch.autograd.grad(model.head(torch.ones(1, 16, dtype=torch.float16)).sum(), model.head.weight)
    torch.testing.assert_close(master_w.grad, 2 * grads[0])  # autograd.grad leaves it alone


def test_groups_added_after_wrapping_get_masters_too() -> None:
    low, ref = _fp16_and_fp32_twins()
    opt = torch.optim.SGD(low[0].parameters(), lr=0.1)
    masters = mixprec.MasterWeights(opt)
    opt.add_param_group({"params": list(low[2].parameters()), "lr": 0.05})
    ref_opt = torch.optim.SGD(ref[0].parameters(), lr=0.1)
    ref_opt.add_param_group({"params": list(ref[2].parameters()), "lr": 0.05})
    assert len(masters.pairs) == 4
    assert all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])
    for model, optimizer in ((low, opt), (ref, ref_opt)):
        scaler = mixprec.GradScaler()
        for _ in range(3):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(X).float(), Y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    for master, reference in zip(
        [p for g in opt.param_groups for p in g["params"]],
        [p for g in ref_opt.param_groups for p in g["params"]],
        strict=True,
    ):
        assert torch.equal(master, reference)
    with pytest.raises(ConfigError, match="already in this optimizer"):
        opt.add_param_group({"params": [low[0].weight]})
