"""Each private torch API of the "autocast and the fp8 hook" section of torch_compat, checked on
the torch this runs under (what it returns, and that it still finds what mixprec reads)."""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from mixprec._src import torch_compat as tc
from mixprec._src.autocast.ops import current_checkpoint


def test_disable_dynamo_and_mark_constant_keep_the_function() -> None:
    def f(x: int) -> int:
        return x + 1

    assert tc.disable_dynamo(f)(1) == 2
    assert tc.mark_constant(f) is f and f._dynamo_marked_constant is True  # type: ignore[attr-defined]


def test_function_mode_and_autocast_object_state() -> None:
    assert not tc.torch_function_mode_active()
    with TorchFunctionMode():
        assert tc.torch_function_mode_active()
    assert tc.autocast_object_enabled(torch.autocast("cpu", dtype=torch.bfloat16))
    assert not tc.autocast_object_enabled(torch.autocast("cpu", enabled=False))


def test_backward_pass_autocast_round_trips() -> None:
    before = tc.backward_pass_autocast()
    tc.set_backward_pass_autocast("off")
    try:
        assert tc.backward_pass_autocast() == "off"
    finally:
        tc.set_backward_pass_autocast(before)
    assert tc.backward_pass_autocast() == before


def test_the_frame_strategy_exists_on_this_torch() -> None:
    assert tc.skip_frames_of((lambda: 0).__code__)


def test_both_checkpoints_are_found_from_their_forwards() -> None:
    assert tc.CHECKPOINT_FRAME_TYPE is not None and tc.REENTRANT_CHECKPOINT_CODE is not None
    assert tc.top_saved_tensors_hooks() is None and current_checkpoint() is None
    found = []

    def body(x: torch.Tensor) -> torch.Tensor:
        found.append(current_checkpoint())
        return x * 2

    x = torch.ones(2, requires_grad=True)
    checkpoint(body, x, use_reentrant=False)
    checkpoint(body, x, use_reentrant=True)
    assert [t[1] for t in found if t is not None] == ["recompute_fn", "run_function"]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert tc.top_saved_tensors_hooks() is not None


def test_a_running_checkpoints_recompute_function_is_read_and_replaced() -> None:
    """Inside a checkpoint's forward its recompute function is found (reentrant or not), and
    what ``set_recompute_function`` puts there is what the recomputation in backward runs."""
    ran: list[str] = []
    found: list[list[str]] = []

    def body(x: torch.Tensor) -> torch.Tensor:
        targets: list[tc.CheckpointTarget] = tc.running_checkpoints()
        found.append([attribute for _, attribute in targets])
        if targets and not ran:
            fn = tc.recompute_function(targets[0])

            def wrapped(*args: Any, **kwargs: Any) -> Any:
                ran.append("wrapped")
                return fn(*args, **kwargs)

            tc.set_recompute_function(targets[0], wrapped)
            ran.append("set")
        return x.sin()

    for reentrant, attribute in ((False, "recompute_fn"), (True, "run_function")):
        ran.clear()
        found.clear()
        x = torch.ones(2, requires_grad=True)
        checkpoint(body, x, use_reentrant=reentrant).sum().backward()
        assert found[0] == [attribute] and ran == ["set", "wrapped"]
        assert x.grad is not None and torch.allclose(x.grad, x.detach().cos())
    assert tc.running_checkpoints() == []


def test_op_name_spells_overloads_as_the_dispatcher() -> None:
    for op in (
        torch.ops.aten.mm.default,
        torch.ops.aten.add.Tensor,
        torch.ops.aten.sum.dim_IntList,
    ):
        schema = op._schema
        want = schema.name + (f".{schema.overload_name}" if schema.overload_name else "")
        assert tc.op_name(op) == want
    assert tc.op_name(torch.ops.aten.mm.default) == "aten::mm"
    assert tc.op_name("not an op") == "not an op"


def test_pytree_leaves_and_the_dispatch_mode() -> None:
    a, b = torch.ones(1), torch.zeros(1)
    assert tc.pytree_leaves({"x": [a, (b, 3)]}) == [a, b, 3]
    seen = []

    class Seen(tc.DispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Seen():
        torch.mm(torch.ones(2, 2), torch.ones(2, 2))
    assert "aten.mm.default" in seen


def test_submodules_is_the_live_child_table() -> None:
    seq = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Tanh())
    children = tc.submodules(seq)
    assert list(children) == ["0", "1"] and children["1"] is seq[1]
    seq.add_module("extra", torch.nn.Identity())
    assert "extra" in children  # the live dict, not a copy


def test_dispatch_registry_names_the_autocast_kernels() -> None:
    names = tc.dispatch_op_names()
    assert "aten::mm" in names
    assert "\nAutocastCPU: registered at" in "\n" + tc.dispatch_dump("aten::mm")
    assert "\nAutocastCPU: registered at" not in "\n" + tc.dispatch_dump("aten::relu")


def test_torch_custom_fwd_state_reads_what_torchs_decorator_records() -> None:
    seen = []

    class Double(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type="cpu")
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            seen.append(tc.torch_custom_fwd_state(ctx))
            return x * 2

        @staticmethod
        @torch.amp.custom_bwd(device_type="cpu")
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad * 2

    x = torch.ones(2, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.float16):
        Double.apply(x)
    Double.apply(x)
    assert seen == [(True, torch.float16), (False, torch.get_autocast_dtype("cpu"))]
    assert tc.torch_custom_fwd_state(object()) is None
