"""The dtype report, the static policy table, native op lists, and CUDA policy via fake tensors."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from tests.autocast_helpers import MLP
from torch import nn

import mixprec
from mixprec import Rule
from mixprec._src.autocast.native import (
    check_native_table,
    native_op_table,
    registered_autocast_ops,
)
from mixprec._src.autocast.ops import OpRuleMode

BF16 = torch.bfloat16


def test_report_rows_forward_and_backward() -> None:
    torch.manual_seed(0)
    model = MLP()
    policy = mixprec.Policy(modules={nn.LayerNorm: "fp32"})
    with mixprec.autocast("cpu", BF16, policy=policy, report=True) as ac:
        loss = model(torch.randn(4, 16)).float().sum()
    rep = ac.report
    assert rep is not None
    assert ("fc1", "aten::addmm", ("bf16", "bf16", "bf16"), "bf16", 1) in rep.rows
    assert ("norm", "aten::native_layer_norm", ("fp32", "fp32", "fp32"), "fp32", 1) in rep.rows
    assert ("fc1", "aten::_to_copy", ("fp32",), "bf16", 3) in rep.rows  # weight, bias, input
    with rep.backward():
        loss.backward()
    ops = {r.op for r in rep.backward_rows}
    assert "aten::mm" in ops
    assert all(r.module == "-" for r in rep.backward_rows)
    text = str(rep)
    assert text.splitlines()[0].split() == ["module", "op", "inputs", "output", "count"]
    assert "backward" in text and "native_layer_norm" in text


def test_report_is_off_by_default_and_does_not_change_results() -> None:
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(4, 16)
    with mixprec.autocast("cpu", BF16) as ac:
        plain = model(x)
    assert ac.report is None
    with mixprec.autocast("cpu", BF16, report=True) as ac2:
        reported = model(x)
    assert torch.equal(plain, reported)
    assert ac2.report is not None and len(ac2.report.rows) > 0


def test_native_table_matches_the_installed_torch() -> None:
    """Fails loudly when torch adds, removes or renames natively autocast ops."""
    for dev in ("cpu", "cuda"):
        missing, extra = check_native_table(dev)
        assert (missing, extra) == ([], []), (
            f"{dev}: table lists ops torch no longer registers: {missing}; "
            f"torch registers ops the table lacks: {extra}. Update mixprec._src.autocast.native."
        )
    # (the table differs between torch releases: native.policies_for; test_torch_compat)
    assert {"aten::mm", "aten::linear"} <= registered_autocast_ops("cpu")
    assert {"aten::mm", "aten::linear"} <= registered_autocast_ops("cuda")


def test_native_table_agrees_with_cpu_behaviour() -> None:
    """Spot-check the policy column against what CPU autocast actually does."""
    table = native_op_table("cpu")
    a = torch.randn(4, 4)
    with torch.autocast("cpu", dtype=BF16):
        assert table["aten::mm"] == "lower_precision_fp" and torch.mm(a, a).dtype == BF16
        assert (
            table["aten::mse_loss"] == "fp32" and F.mse_loss(a.bfloat16(), a).dtype == torch.float32
        )
        assert (
            table["aten::cat"] == "promote" and torch.cat([a.bfloat16(), a]).dtype == torch.float32
        )
        assert "aten::softmax.int" not in table and torch.softmax(a.bfloat16(), -1).dtype == BF16


def test_policy_table_static_view() -> None:
    policy = mixprec.Policy("nn.LayerNorm=fp32, fc1=keep, F.softmax=fp32, aten::gelu=low")
    t = mixprec.policy_table("cpu", policy, model=MLP())
    rows = {(r.kind, r.target): r for r in t.rows}
    assert rows[("op", "aten::mm")].effective == "lower_precision_fp"
    assert rows[("op", "F.softmax")].native == "-"
    assert rows[("op", "aten::gelu")].effective == "low"
    assert rows[("module", "norm")].effective == "fp32"
    assert rows[("module", "fc1")].effective == "keep"
    cuda = mixprec.policy_table("cuda", policy)
    softmax = next(r for r in cuda.rows if r.target == "aten::softmax.int")
    assert (softmax.native, softmax.effective) == ("fp32_set_opt_dtype", "fp32")
    assert str(t).startswith("autocast policy for device_type='cpu'")


# ------------------------------------------------------------------ fake CUDA
@contextmanager
def fake_cuda_autocast(dtype: torch.dtype = torch.float16) -> Iterator[object]:
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    prev = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    try:
        with mode:

            def make(*shape: int, dt: torch.dtype = torch.float32) -> torch.Tensor:
                meta = torch.empty(shape, dtype=dt, device="meta")
                return FakeTensor(mode, meta, torch.device("cuda", 0))

            yield make
    finally:
        torch.set_autocast_enabled("cuda", prev[0])
        torch.set_autocast_dtype("cuda", prev[1])


def test_fake_cuda_native_policies_match_the_table() -> None:
    table = native_op_table("cuda")
    with fake_cuda_autocast() as make:
        x, h = make(4, 4), make(4, 4, dt=torch.float16)
        assert x.device.type == "cuda"
        assert table["aten::mm"] == "lower_precision_fp" and torch.mm(x, x).dtype == torch.float16
        assert table["aten::softmax.int"] == "fp32_set_opt_dtype"
        assert torch.softmax(h, -1).dtype == torch.float32
        assert table["aten::layer_norm"] == "fp32" and F.layer_norm(h, (4,)).dtype == torch.float32
        assert table["aten::addcmul"] == "promote"
        assert torch.addcmul(h, x, x).dtype == torch.float32
        assert table["aten::binary_cross_entropy"] == "banned"
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(torch.sigmoid(h), h)


def test_fake_cuda_op_rules_apply() -> None:
    rules = {"gelu": Rule("fp32"), "softmax": Rule("low"), "mm": Rule("fp32")}
    with fake_cuda_autocast() as make:
        h = make(4, 4, dt=torch.float16)
        with OpRuleMode(rules, "cuda"):
            assert F.gelu(h).dtype == torch.float32
            assert torch.softmax(h, -1).dtype == torch.float16  # native would upcast on CUDA
            assert torch.mm(h, h).dtype == torch.float32
        assert F.gelu(h).dtype == torch.float16  # not listed natively: runs in its input dtype


def test_cuda_region_without_gpu_warns_and_disables() -> None:
    if torch.cuda.is_available():
        pytest.skip("this checks the CPU-only behaviour; a GPU is present")
    with pytest.warns(UserWarning, match="CUDA is not available"), mixprec.autocast("cuda"):
        assert not torch.is_autocast_enabled("cuda")


def test_report_views_option_and_standalone_recording() -> None:
    rep = mixprec.types.DtypeReport(include_views=True)
    x = torch.randn(4, 4)
    with mixprec.autocast("cpu", BF16), rep.record():
        (x.t() @ x).sum()
    ops = [r.op for r in rep.rows]
    assert "aten::t" in ops and "aten::mm" in ops
    assert ("-", "aten::mm", ("bf16", "bf16"), "bf16", 1) in rep.rows
    plain = mixprec.types.DtypeReport()
    with plain.record():
        x.t()
    assert plain.rows == []
    assert repr(rep).startswith("DtypeReport(")


def test_policy_table_without_policy_lists_every_native_op() -> None:
    table = mixprec.policy_table("cpu")
    assert {r.target for r in table.rows} == set(native_op_table("cpu"))
    assert all(r.rule == "-" and r.effective == r.native for r in table.rows)
