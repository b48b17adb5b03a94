"""The dry run (``mixprec.dry_run``): mixprec's own kernel calls against CUDA's contract on the
meta device, each check with a negative control, and the bytes saved for backward."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import mixprec
from mixprec._src.advisor.speed.gpus import GPUS
from mixprec._src.dryrun import rules
from mixprec._src.dryrun.memory import count_saved, reference_bytes
from mixprec._src.dryrun.run import EMULATED, HIGH, NATIVE
from mixprec._src.fp8.kernels import KernelCall, to_blocked
from mixprec._src.fp8.recipes import RECIPES, WORDS
from mixprec.errors import ConfigError

_WORD = {r: (w if r == WORDS[w][0] else f"{w}:{r}") for w, rs in WORDS.items() for r in rs}


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().square().mean()


def _linear_run(recipe: str, gpu: str, m: int = 256, k: int = 512, n: int = 384) -> Any:
    model = nn.Sequential(nn.Linear(k, n))
    x = torch.randn(m, k, requires_grad=True)  # the input gradient's matmul runs too
    return mixprec.dry_run(model, x, _loss, f"0={_WORD[recipe]}", gpu=gpu)


def _runs_natively(recipe: str, gpu: str) -> bool:
    low, high = RECIPES[recipe].capability
    return low <= GPUS[gpu].capability < high


@pytest.mark.parametrize("gpu", ["h100", "b200"])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize(("k", "n"), [(512, 384), (1024, 256), (256, 1024)])
def test_own_calls_keep_the_contract(recipe: str, gpu: str, k: int, n: int) -> None:
    """Every recipe's matmuls on either GPU: native exactly where the recipe's capability range
    includes the GPU's, emulated (saying why) elsewhere, never a call that would fail; feature
    counts whose 128-blocks are and are not multiples of 4 (the 128x128 scale padding)."""
    run = _linear_run(recipe, gpu, k=k, n=n)
    assert run.ok, run.table()
    assert {mm for _, mm in run.verdicts()} == set(_MM)
    low = {v for (_, mm), v in run.verdicts().items() if RECIPES[recipe].pairs[_MM[mm]][0]}
    want = NATIVE if _runs_natively(recipe, gpu) else EMULATED
    assert low == {want}, run.table()
    assert {v for v in run.verdicts().values()} <= {want, HIGH}


_MM = {"fprop": 0, "dgrad": 1, "wgrad": 2}


def _calls(recipe: str, gpu: str, m: int = 256) -> list[KernelCall]:
    calls = [r.call for r in _linear_run(recipe, gpu, m=m).rows if r.call is not None]
    assert calls, recipe
    return calls


def _meta(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _broken(call: KernelCall, cap: tuple[int, int]) -> set[str]:
    return {b.rule for b in rules.check(call, cap)[1]}


def _k200(c: KernelCall) -> KernelCall:
    return dataclasses.replace(
        c, a=_meta((256, 200), c.a.dtype), b=_meta((384, 200), c.b.dtype).t()
    )


def _row_major_b(c: KernelCall) -> KernelCall:
    return dataclasses.replace(c, b=c.b.contiguous())


def _wgrad_60(c: KernelCall) -> KernelCall:
    return dataclasses.replace(c, a=_meta((384, 60), c.a.dtype), b=_meta((512, 60), c.b.dtype).t())


def _e5m2_pair(c: KernelCall) -> KernelCall:
    e5 = torch.float8_e5m2
    return dataclasses.replace(c, a=c.a.to(e5), b=c.b.contiguous().to(e5).t().contiguous().t())


def _bias_fp32(c: KernelCall) -> KernelCall:
    bias = _meta((c.b.shape[1],), torch.bfloat16)
    return dataclasses.replace(c, out_dtype=torch.float32, bias=bias)


def _fast_fp4(c: KernelCall) -> KernelCall:
    return dataclasses.replace(c, fast_accum=True)


def _unpadded_mx(c: KernelCall) -> KernelCall:
    assert isinstance(c.scale_a, torch.Tensor)
    rows, cols = c.a.shape[0], c.a.shape[1] // 32 - 1
    return dataclasses.replace(c, scale_a=_meta((rows * cols,), c.scale_a.dtype))


# (name, recipe whose call is broken, GPU, the breakage, the rule that must catch it)
NEGATIVE = [
    ("K=200", "tensorwise", "h100", _k200, "meta_kernel"),
    ("row-major B", "rowwise", "h100", _row_major_b, "meta_kernel"),
    ("60-token wgrad", "tensorwise", "h100", _wgrad_60, "meta_kernel"),
    ("unpadded MX scales", "mxfp8", "b200", _unpadded_mx, "mx_scale_count"),
    ("e5m2 x e5m2", "tensorwise", "h100", _e5m2_pair, "e5m2_x_e5m2"),
    ("bf16 bias, fp32 out", "tensorwise", "h100", _bias_fp32, "bias"),
    ("fp4 fast accumulation", "nvfp4", "b200", _fast_fp4, "fp4_fast_accum"),
    ("1x128 blocks on B200", "blockwise", "h100", None, "arch_128_blocks"),
    ("MXFP8 on H100", "mxfp8", "b200", None, "arch_mx_nvfp4"),
    ("fp8 before 8.9", "tensorwise", "h100", None, "arch_fp8"),
]
_OTHER_GPU = {"arch_128_blocks": (10, 0), "arch_mx_nvfp4": (9, 0), "arch_fp8": (8, 0)}


@pytest.mark.parametrize(
    ("recipe", "gpu", "breakage", "rule"), [n[1:] for n in NEGATIVE], ids=[n[0] for n in NEGATIVE]
)
def test_negative_controls(recipe: str, gpu: str, breakage: Any, rule: str) -> None:
    """mixprec's own call passes every check; the same call broken one way is caught by the
    rule that owns that breakage (and a call moved to a GPU without its kernel by the
    architecture rule)."""
    call = _calls(recipe, gpu)[0]
    cap = GPUS[gpu].capability
    assert _broken(call, cap) == set()
    if breakage is None:
        assert rule in _broken(call, _OTHER_GPU[rule])
    else:
        assert rule in _broken(breakage(call), cap)


def test_bias_rules_each_caught() -> None:
    """The bias rule's cases apart: another dtype than the output, another size; a matching
    bf16 bias with bf16 output passes."""
    call = dataclasses.replace(_calls("tensorwise", "h100")[0], out_dtype=torch.bfloat16)
    n = call.b.shape[1]
    ok = dataclasses.replace(call, bias=_meta((n,), torch.bfloat16))
    assert _broken(ok, (9, 0)) == set()
    assert "bias" in _broken(dataclasses.replace(call, bias=_meta((n,), torch.float16)), (9, 0))
    assert "bias" in _broken(
        dataclasses.replace(call, bias=_meta((n + 1,), torch.bfloat16)), (9, 0)
    )


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 300), cols=st.integers(1, 12), swap=st.integers(0, 10**6))
def test_swizzle_matches_cublas_formula(rows: int, cols: int, swap: int) -> None:
    """mixprec's swizzle (kernels.to_blocked) puts every block scale where cuBLAS's 128x4
    formula reads it; the unswizzled (padded, row-major) scales and a swizzle with two scales
    exchanged are caught."""
    logical = torch.arange(1, rows * cols + 1, dtype=torch.float32).reshape(rows, cols)
    good = to_blocked(logical)
    assert rules.check_swizzle(logical, good) is None
    plain = torch.nn.functional.pad(logical, (0, -cols % 4, 0, -rows % 128)).reshape(-1)
    if rows > 1 or cols > 1:
        assert rules.check_swizzle(logical, plain) is not None or plain.equal(good)
        i = rules.swizzle_index(rows, cols).reshape(-1)
        a, b = i[swap % i.numel()], i[(swap + 1) % i.numel()]
        bad = good.clone()
        bad[a], bad[b] = good[b], good[a]
        assert rules.check_swizzle(logical, bad) is not None
    assert rules.check_swizzle(logical, good[:-1]) is not None  # a scale missing


def _gpt() -> Any:
    path = Path(__file__).resolve().parents[2] / "examples" / "advise_gpt.py"
    spec = importlib.util.spec_from_file_location("advise_gpt_dry", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.make_gpt(batch=2, seq=64)


@pytest.mark.parametrize("gpu", ["h100", "b200"])
@pytest.mark.parametrize("rule", ["fp8", "fp8:blockwise", "mxfp8", "nvfp4"])
def test_gpt_every_matmul_answered(gpu: str, rule: str) -> None:
    """examples/advise_gpt.py's GPT: every ruled Linear's three matmuls get an answer, native
    exactly where the recipe has a kernel on the GPU; the user's model is untouched."""
    model, batch, loss_fn = _gpt()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    run = mixprec.dry_run(model, batch, loss_fn, f"blocks=bf16, blocks.*.mlp.*={rule}", gpu=gpu)
    assert run.ok, run.table()
    ruled = {n for n, m in model.named_modules() if ".mlp." in n and isinstance(m, nn.Linear)}
    assert {key[0] for key in run.verdicts()} == ruled
    recipe = mixprec.Rule(rule).recipe
    want = NATIVE if _runs_natively(recipe, gpu) else EMULATED
    assert set(run.verdicts().values()) == {want}
    for name, p in model.named_parameters():
        assert p.device.type == "cpu" and p.grad is None and torch.equal(p, before[name])
    assert max(len(line) for line in run.table().splitlines()) <= 100


def test_per_matmul_mix() -> None:
    """A rule per matmul: each matmul's own recipe routed (b200 runs mxfp8 and nvfp4); on an
    h100 the mix is refused as training would refuse it (the dry run says so)."""
    model, batch, loss_fn = _gpt()
    mix = "blocks.*.mlp.*=mxfp8/mxfp8/nvfp4"
    run = mixprec.dry_run(model, batch, loss_fn, mix, gpu="b200")
    assert run.ok and set(run.verdicts().values()) == {NATIVE}
    assert {r.recipe for r in run.rows if r.matmul == "wgrad"} == {"nvfp4"}
    mixed = mixprec.dry_run(model, batch, loss_fn, "blocks.*.mlp.*=bf16/fp8/mxfp8", gpu="h100")
    assert not mixed.ok and mixed.error is not None and "mxfp8" in mixed.error


@pytest.mark.parametrize("tokens", [60, 100])
def test_tokens_not_multiple_of_16_emulated_with_the_fix(tokens: int) -> None:
    """A batch of 60 tokens: mixprec takes the emulated path (no kernel call that would fail)
    and the dry run says to pad the tokens."""
    run = _linear_run("tensorwise", "h100", m=tokens)
    assert run.ok
    assert {r.verdict for r in run.rows} == {EMULATED}
    assert all("pad tokens" in r.detail for r in run.rows)


def test_unknown_gpu_refused() -> None:
    with pytest.raises(ConfigError, match="a100x"):
        mixprec.dry_run(nn.Linear(4, 4), torch.ones(1, 4), _loss, "fp8", gpu="a100x")


@pytest.mark.parametrize("rule", ["fp8", "fp8:rowwise", "fp8:blockwise", "mxfp8", "nvfp4"])
def test_meta_bytes_equal_cpu_bytes(rule: str) -> None:
    """The bytes the dry run counts on meta tensors equal those a real CPU step saves (for
    low-precision rules: meta has no autocast, so bf16 ones run in fp32 there)."""
    model = nn.Sequential(nn.Linear(128, 256))
    x = torch.randn(32, 128)
    run = mixprec.dry_run(model, x, _loss, f"0={rule}", gpu="b200")
    region = mixprec.autocast("cpu", torch.bfloat16, policy=f"0={rule}")
    with count_saved(model) as counter, region:
        loss = _loss(model, x)
    loss.backward()
    meta = {s.module: s.mixprec for s in run.saved}
    assert meta == {k: sum(v.values()) for k, v in counter.seen.items()}


def test_references_differential() -> None:
    """bf16 autocast's reference equals a real bf16 autocast step's bytes (x and W in bf16);
    torchao's saves the bf16 input only."""
    m, k, n = 32, 64, 48
    lin = nn.Sequential(nn.Linear(k, n))
    x = torch.randn(m, k, dtype=torch.bfloat16, requires_grad=True)
    with count_saved(lin) as counter, torch.autocast("cpu", torch.bfloat16):
        lin(x)
    real = sum(sum(v.values()) for v in counter.seen.values())
    assert reference_bytes((m, k, n), "bf16", True) == real
    assert reference_bytes((m, k, n), "tensorwise", False) == m * k * 2
    assert reference_bytes((m, k, n), "nvfp4", False) is None


def test_cli(capsys: pytest.CaptureFixture[str]) -> None:
    """``mixprec dry-run``: a table per GPU at most 100 columns wide, status 0 when every call
    keeps the contract; an unknown GPU is a usage error (status 2)."""
    from mixprec.cli import main

    target = f"{Path(__file__).resolve().parents[2] / 'examples' / 'advise_gpt.py'}:make_gpt"
    status = main(["dry-run", target, "--policy", "blocks.*.mlp.*=mxfp8", "--gpu", "h100,b200"])
    out = capsys.readouterr().out
    assert status == 0
    assert "dry run on h100" in out and "dry run on b200" in out
    assert "no mxfp8 kernel on h100" in out and "F.scaled_mm BlockWise1x32" in out
    assert max(len(line) for line in out.splitlines()) <= 100
    assert main(["dry-run", target, "--policy", "fp8", "--gpu", "a100x"]) == 2


def _gpu_check() -> Any:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check_dry", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_dry_run_section_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/gpu_check.py's section 6 on the CPU: as it is, the CPU emulates what the dry
    run says an h100 runs natively (reported as differing, the 60-token case agreeing); with
    the CPU routed as a 9.0 GPU (torch's CPU _scaled_mm runs tensorwise and rowwise), each
    kernel call recorded as it ran agrees with the dry run, outputs near emulation."""
    from mixprec._src.devices import caps
    from mixprec._src.fp8 import matmul

    check = _gpu_check()
    monkeypatch.setattr(check, "DRY_RULES", ("fp8", "fp8:rowwise"))
    monkeypatch.setattr(check, "DRY_SHAPES", ((64, 128, 96), (60, 128, 96)))
    rows, ok = check.dry_run_check(torch.device("cpu"))
    assert not ok
    assert "| fp8 | 64x128x96 | N/N/N | E/E/E |" in "\n".join(rows)
    assert [r for r in rows if "60x128x96" in r and "DIFFERS" in r] == []
    monkeypatch.setattr(matmul, "caps", lambda device: caps("cuda"))
    monkeypatch.setattr(matmul, "_capability", lambda device: (9, 0))
    rows, ok = check.dry_run_check(torch.device("cpu"))
    assert ok, "\n".join(rows)
    assert "| fp8:rowwise | 64x128x96 | N/N/N | N/N/N |" in "\n".join(rows)


def test_e2m1_pack_round_trip() -> None:
    """Every e2m1 value (both zeros included) survives packing two a byte, bit for bit."""
    from mixprec._src.fp8.kernels import _E2M1_CODES, pack_e2m1, unpack_e2m1

    levels = torch.tensor(_E2M1_CODES)
    values = torch.cat((levels, -levels)).to(torch.float8_e4m3fn)
    grid = torch.cartesian_prod(torch.arange(16), torch.arange(16))
    codes = values[grid]  # every pair of codes in one byte
    back = unpack_e2m1(pack_e2m1(codes.float()))
    assert torch.equal(back.view(torch.uint8), codes.view(torch.uint8))


def test_nvfp4_saves_weight_codes_packed() -> None:
    """NVFP4's saved 16x16-block weight codes take half a byte each: its bytes exceed MXFP8's
    (the same high-precision input saved, no weight) by the packed codes and their scales."""
    k, n = 256, 512
    saved = {}
    for rule in ("mxfp8", "nvfp4"):
        model = nn.Sequential(nn.Linear(k, n, bias=False))
        x = torch.randn(64, k, requires_grad=True)
        run = mixprec.dry_run(model, x, _loss, f"0={rule}", gpu="b200")
        saved[rule] = {s.module: s.mixprec for s in run.saved}["0"]
    assert saved["nvfp4"] - saved["mxfp8"] == n * k // 2 + (n // 16) * (k // 16) + 4


class _Tied(nn.Module):
    """Tied embedding and head, a BatchNorm's buffers, a dict batch."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 128)
        self.norm = nn.BatchNorm1d(128)
        self.head = nn.Linear(128, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.head(self.norm(self.emb(batch["ids"])))


def test_tied_weights_buffers_and_a_dict_batch() -> None:
    """The meta copy keeps ties and copies buffers: the user's running statistics, step count
    and weights stay as they were; the tied head's three matmuls are answered."""
    model = _Tied()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = {"ids": torch.randint(0, 64, (48,))}
    run = mixprec.dry_run(model, batch, lambda m, b: m(b).float().mean(), "head=fp8", "h100")
    assert run.ok and run.verdicts() == {("head", mm): NATIVE for mm in _MM}
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert model.head.weight is model.emb.weight


@pytest.mark.parametrize(("x_grad", "w_grad"), [(True, True), (True, False), (False, True)])
def test_packed_codes_change_no_gradient(
    monkeypatch: pytest.MonkeyPatch, x_grad: bool, w_grad: bool
) -> None:
    """NVFP4 with its saved weight codes packed gives bit for bit the gradients of the run
    that keeps them one a byte, whichever operands need a gradient."""
    from mixprec._src.fp8 import matmul

    def step() -> list[torch.Tensor | None]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 32)).requires_grad_(w_grad)
        x = torch.randn(48, 64, requires_grad=x_grad)
        with mixprec.autocast("cpu", torch.bfloat16, policy="0=nvfp4"):
            loss = _loss(model, x)
        loss.backward()
        return [x.grad, model[0].weight.grad]

    packed = step()
    monkeypatch.setattr(matmul, "E2M1", None)  # nothing is packed
    plain = step()
    for a, b in zip(packed, plain, strict=True):
        assert (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
